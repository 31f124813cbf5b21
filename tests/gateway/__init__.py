"""The gateway: renderers, SGLang's /generate and native endpoints, the OpenAI routes, the public gRPC API,
validation of what clients send."""
