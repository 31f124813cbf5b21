"""Imported by the interpreter as it starts (Python's sitecustomize hook), in a scheduler that a test starts with
this folder on its PYTHONPATH: that scheduler's model raises in any step that holds the token
FLATWIRE_TEST_FAULT_TOKEN, as a model with a fault would, and runs every other step as it is."""

import os

from services.scheduler.model import runner

MARKED = int(os.environ["FLATWIRE_TEST_FAULT_TOKEN"])
_forward = runner.ModelRunner.forward


def _faulty_forward(self, batch, input_ids, positions):
    if MARKED in input_ids:
        raise RuntimeError(f"token {MARKED} is marked to fail")
    return _forward(self, batch, input_ids, positions)


runner.ModelRunner.forward = _faulty_forward  # type: ignore[method-assign]
