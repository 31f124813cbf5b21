"""Request bodies the gateway's tests share."""

SERVED = "<the served model>"  # a body's "model" that the send fixture replaces by the name /v1/models gives
CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
