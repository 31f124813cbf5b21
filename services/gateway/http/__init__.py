"""The gateway's REST API: SGLang /generate, OpenAI /v1/*, /health, /metrics."""
