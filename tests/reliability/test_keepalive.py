"""Keepalive agrees on every hop: idle long-lived streams are pinged, and never cut for it.

The services run with a 0.5 s keepalive (FLATWIRE_KEEPALIVE_S), so an idle step stream
and output stream see a dozen pings in the test. A server that did not permit its
clients' ping rate would answer GOAWAY too_many_pings after two of them and cut both
streams (the detokenizer and gateway log every cut).
"""

import time

import httpx
import pytest

from harness.procs import ServiceProcess, free_port
from services.common.rpc import check_health

pytestmark = pytest.mark.slow  # runs services as processes of its own

KEEPALIVE = {"FLATWIRE_KEEPALIVE_S": "0.5"}
IDLE_S = 6.0
CUTS = ("stream:", "ended its step stream", "stream ended", "too_many_pings", "GOAWAY")


def test_idle_streams_survive_fast_keepalive_pings(model_dir, log_dir):
    ports = {name: free_port() for name in ("scheduler", "detokenizer", "http", "grpc")}
    scheduler, detokenizer = f"127.0.0.1:{ports['scheduler']}", f"127.0.0.1:{ports['detokenizer']}"
    model = ["--model", str(model_dir)]
    procs = []
    try:
        procs.append(ServiceProcess("scheduler", ["--port", str(ports["scheduler"]), *model], log_dir, KEEPALIVE))
        procs[-1].wait_healthy(scheduler)
        procs.append(ServiceProcess("detokenizer", ["--port", str(ports["detokenizer"]), "--schedulers", scheduler,
                                                    *model], log_dir, KEEPALIVE))
        procs[-1].wait_healthy(detokenizer)
        procs.append(ServiceProcess("gateway", [
            "--port", str(ports["http"]), "--grpc-port", str(ports["grpc"]), "--schedulers", scheduler,
            "--detokenizers", detokenizer, *model], log_dir, {**KEEPALIVE, "GRPC_TRACE": "http_keepalive",
                                                             "GRPC_VERBOSITY": "debug"}))
        procs[-1].wait_healthy(f"127.0.0.1:{ports['grpc']}")
        time.sleep(IDLE_S)
        assert check_health(detokenizer), "the detokenizer lost its scheduler stream"
        reply = httpx.post(f"http://127.0.0.1:{ports['http']}/generate", timeout=60,
                           json={"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        assert reply.status_code == 200, reply.text
        gateway_log = procs[-1].log()
        assert gateway_log.count("Finish keepalive ping") > 3, \
            "the gateway's channels completed no keepalive pings: the test would prove nothing"
        for proc in procs:
            log = proc.log()
            assert not [line for line in log.splitlines() if any(cut in line for cut in CUTS)], \
                f"{proc.command} saw a stream cut:\n{log[-3000:]}"
    finally:
        for proc in reversed(procs):
            proc.stop()
