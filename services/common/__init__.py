"""Code every service shares: wire codecs, config, gRPC helpers, the model store."""
