"""services/ type-checks: mypy, configured in pyproject.toml ([tool.mypy])."""

import subprocess
import sys

import pytest

from harness.procs import ROOT

pytestmark = pytest.mark.slow  # a mypy run: seconds, from a cold cache


def test_mypy_finds_no_errors_in_services():
    check = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
