"""`flatwire up` starts the three services, serves, and stops them all on Ctrl-C."""

import signal
import subprocess
import sys
import time

import httpx

from services.common.rpc import check_health
from tests.procs import ROOT, free_port


def test_up_serves_and_stops_cleanly(model_dir, tmp_path):
    ports = {name: free_port() for name in ("port", "grpc-port", "scheduler-port", "detokenizer-port")}
    args = [f"--{name}={port}" for name, port in ports.items()]
    log = open(tmp_path / "up.log", "w+")
    up = subprocess.Popen([sys.executable, "-m", "services", "up", "--model", str(model_dir), *args],
                          cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while "flatwire is up" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "flatwire up did not come up"
            time.sleep(0.5)
        reply = httpx.post(f"http://127.0.0.1:{ports['port']}/generate", timeout=60,
                           json={"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 4
        assert check_health(f"127.0.0.1:{ports['grpc-port']}")
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0, (tmp_path / "up.log").read_text()
    for name in ("scheduler-port", "detokenizer-port", "grpc-port"):
        assert not check_health(f"127.0.0.1:{ports[name]}", timeout=0.5), f"{name} still serving"
