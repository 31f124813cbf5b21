"""The tests, one sub-package per area; shared fixtures in conftest.py; the services run as processes through
harness/ (shared with bench/)."""
