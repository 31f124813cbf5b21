"""A scheduler that fails ends at once, whatever threads it has running."""

import subprocess
import sys

from harness.procs import ROOT

CRASHING_SCHEDULER = """
import threading, time
import services.scheduler.server as server

# As a weight-group join waiting out its rendezvous for a trainer that never comes: an ordinary (non-daemon)
# thread, which the interpreter's own exit would wait for.
threading.Thread(target=time.sleep, args=(600,)).start()

async def failing_serve(config):
    raise RuntimeError("a bug in serve")

server.serve = failing_serve
server.main(["--port", "0"])
"""


def test_a_scheduler_that_fails_exits_at_once_with_its_traceback():
    done = subprocess.run([sys.executable, "-c", CRASHING_SCHEDULER], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stderr
    assert "the scheduler failed" in done.stderr and "RuntimeError: a bug in serve" in done.stderr, done.stderr
