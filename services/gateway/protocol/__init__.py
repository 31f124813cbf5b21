"""Request models of the gateway's HTTP API (SGLang /generate and OpenAI), validated with pydantic."""
