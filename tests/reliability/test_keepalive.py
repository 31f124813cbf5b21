"""Keepalive agrees on every hop: idle long-lived streams are pinged, and never cut for it.

The services run with a 0.5 s keepalive (FLATWIRE_KEEPALIVE_S), so an idle step stream
and output stream see a dozen pings in the test. A server that did not permit its
clients' ping rate would answer GOAWAY too_many_pings after two of them and cut both
streams (the detokenizer and gateway log every cut).
"""

import time

import pytest

from harness.http import generate
from harness.stack import running
from services.common.rpc import check_health

pytestmark = pytest.mark.slow  # runs services as processes of its own

KEEPALIVE = {"FLATWIRE_KEEPALIVE_S": "0.5"}
IDLE_S = 6.0
CUTS = ("stream:", "ended its step stream", "stream ended", "too_many_pings", "GOAWAY")


def test_idle_streams_survive_fast_keepalive_pings(model_dir, log_dir):
    with running(model_dir, log_dir, env=KEEPALIVE,
                 gateway_env={"GRPC_TRACE": "http_keepalive", "GRPC_VERBOSITY": "debug"}) as stack:
        time.sleep(IDLE_S)
        assert check_health(stack.detokenizer_address), "the detokenizer lost its scheduler stream"
        generate(stack.http_url, text="hello", sampling_params={"max_new_tokens": 4})
        gateway_log = stack.procs["gateway"].log()
        assert gateway_log.count("Finish keepalive ping") > 3, \
            "the gateway's channels completed no keepalive pings: the test would prove nothing"
        for proc in stack.procs.values():
            log = proc.log()
            assert not [line for line in log.splitlines() if any(cut in line for cut in CUTS)], \
                f"{proc.command} saw a stream cut:\n{log[-3000:]}"
