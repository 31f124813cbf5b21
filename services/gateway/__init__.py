"""The gateway: tokenization, REST and public gRPC APIs, response rendering."""
