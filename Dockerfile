# One image, three entry points (flatwire scheduler | detokenizer | gateway): one build,
# and every service in a deployment is guaranteed to speak the same protos.
FROM python:3.11-slim

# cpu: the CPU build of torch; cuda: PyPI's default (CUDA) build, for hosts with a GPU.
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
RUN if [ "$TORCH_VARIANT" = "cpu" ]; then \
        pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu; \
    else \
        pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    fi

WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
RUN pip install --no-cache-dir .

# No weights in the image: the model (or the built default) lives in this volume.
ENV FLATWIRE_CACHE_DIR=/models \
    FLATWIRE_HOST=0.0.0.0
VOLUME /models
EXPOSE 30000 30001
CMD ["flatwire", "up", "--host", "0.0.0.0"]
