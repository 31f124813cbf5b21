"""The committed stubs are exactly what protos/ generates."""

import subprocess
import sys

import pytest

from harness.procs import ROOT

pytestmark = pytest.mark.slow  # runs protoc


def test_committed_stubs_match_protos():
    check = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_check_notices_a_stale_stub(tmp_path, monkeypatch):
    """The check can fail: a stub edited by hand is reported."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    stubs = tmp_path / "pb"
    gen_protos.generate(stubs)
    (stubs / "arrays_pb2.py").write_text((stubs / "arrays_pb2.py").read_text() + "# edited\n")
    monkeypatch.setattr(gen_protos, "ROOT", tmp_path)
    monkeypatch.setattr(gen_protos, "OUT", stubs)
    monkeypatch.setattr(sys, "argv", ["gen_protos.py", "--check"])
    try:
        gen_protos.main()
    except SystemExit as exc:
        assert "arrays_pb2.py" in str(exc)
    else:
        raise AssertionError("a stale stub passed the check")
