"""The client package (clients/python: flatwire-client) against the live stack, and installed on its own."""
