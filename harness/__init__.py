"""The project's development harness, shared by tests/ and bench/: start the real services as processes on
loopback (one service, a whole stack, `flatwire up`) and talk to them (HTTP helpers, step-stream clients).

Neither tests/ nor bench/ imports the other; what both need lives here.
"""
