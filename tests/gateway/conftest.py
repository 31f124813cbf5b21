import pytest

from harness.http import post
from tests.gateway.bodies import SERVED


@pytest.fixture(scope="session")
def send(http, served_model):
    """send(endpoint, body) -> response: `body` POSTed to the session's gateway (JSON; bytes as they are),
    its "model" replaced by the served model's name where it is SERVED."""

    def send(endpoint: str, body):
        if isinstance(body, dict) and body.get("model") == SERVED:
            body = {**body, "model": served_model}
        return post(http, endpoint, body)

    return send
