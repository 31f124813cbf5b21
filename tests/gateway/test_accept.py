"""Content negotiation of /generate's protobuf answer (services/gateway/http/accept.py), in process."""

import pytest

from services.gateway.http.accept import prefers

PROTOBUF = "application/x-protobuf"


@pytest.mark.parametrize(("accept", "wanted"), [
    (None, False),
    ("", False),
    ("application/x-protobuf", True),
    ("Application/X-Protobuf", True),
    ("application/x-protobuf;q=0", False),
    ("application/x-protobuf; q=0.5, application/json", False),
    ("application/json;q=0.4, application/x-protobuf;q=0.5", True),
    ("*/*", False),
    ("application/*", False),
    ("application/x-protobuf, */*", True),  # named beats a wildcard at the same q
    ("application/x-protobuf, application/json", False),  # named both: JSON, the default, wins a tie
    ("*/*, application/x-protobuf;q=0", False),  # the most specific range decides
    ("application/x-protobuf;q=oops", False),
    ("text/html, application/x-protobuf;q=0.9", True),
])
def test_protobuf_only_when_preferred_to_json(accept, wanted):
    assert prefers(accept, PROTOBUF) is wanted
