"""A constrained request's grammar compiles after its Submit answered (RequestStatus.COMPILING): the engine runs
everything else meanwhile, then gets it in line; an abort or a failed compile ends only that request.

The engine runs in process, stepped by the test (engine_run.Run), on the small vocabulary's model
(tests/conftest.py small_model_dir), with Grammars that compile for real once the test lets them (HeldGrammars).
Reading the vocabulary outside the server process is checked on the default model's: its 248k tokens are what
takes seconds."""

import re
import threading
import time

import pytest
from flatwire_wire.scheduler import AbortRequest
from flatwire_wire.steps import FinishReason
from transformers import AutoConfig, AutoTokenizer

from services.scheduler.model.runner import ModelRunner
from services.scheduler.request import RequestStatus
from services.scheduler.sampling.grammar import Grammars, VocabularyCache
from services.scheduler.submit import InvalidTokenizedRequest
from tests.scheduler.engine_run import Run

REGEX = "[a-z]{3}-[0-9]{2}"


class HeldGrammars(Grammars):
    """Grammars whose compiles wait for `go` (and fail with `failure`, when set)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.go = threading.Event()
        self.failure: Exception | None = None

    def matcher(self, grammar, stop_ids):
        assert self.go.wait(60)
        if self.failure is not None:
            raise self.failure
        return super().matcher(grammar, stop_ids)


@pytest.fixture(scope="module")
def runner(small_model_dir):
    return ModelRunner(small_model_dir, "cpu", "float32", 0, 4, 4, 2048)


@pytest.fixture(scope="module")
def tokenizer(small_model_dir):
    return AutoTokenizer.from_pretrained(small_model_dir)


def constrained_run(runner: ModelRunner, model_dir, **options) -> Run:
    """The engine stepped by the test, its requests' grammars compiled by HeldGrammars."""
    # The vocabulary is kept beside the model, read once in the session.
    grammars = HeldGrammars(model_dir, runner.vocab_size, runner.eos_token_ids, model_dir.parent)
    return Run(runner, slots=4, grammars=grammars, max_total_tokens=2048, **options)


def ask(run: Run, rid: str, **sampling) -> None:
    run.send(rid, [39, 300, 379, 11, 1814], max_new_tokens=12, temperature=0, **sampling)  # "Hello, world"


@pytest.fixture
def run(runner, small_model_dir):
    run = constrained_run(runner, small_model_dir)
    yield run
    run.grammars.go.set()


def test_others_run_while_a_grammar_compiles(run, tokenizer):
    ask(run, "constrained", regex=REGEX)
    ask(run, "free", ignore_eos=True)
    run.step(20)
    assert run.finish("free").reason is FinishReason.LENGTH  # done while the other compiles
    [held] = run.engine.scheduler.requests
    assert (held.rid, held.status) == ("constrained", RequestStatus.COMPILING)
    assert run.engine.stats.waiting == 1 and not run.output("constrained")
    run.grammars.go.set()
    held.compiling.result(timeout=60)
    run.step(20)
    assert run.finish("constrained").reason is FinishReason.STOP_TOKEN
    assert re.fullmatch(REGEX, tokenizer.decode(run.output("constrained")[:-1]))


def test_the_vocabulary_is_read_outside_the_server_process_and_kept(model_dir, tmp_path, monkeypatch):
    """The server reads the tokenizer as it starts (prepare), and a compile waits for it; parsing tokenizer.json
    holds the GIL for seconds, and in this process the scheduler would answer nothing meanwhile (on a busy host:
    out of rotation). Here a thread that wakes every 10 ms is never held up for long. What was read is kept in
    the cache directory, and the next start reads that instead. On the default model: its vocabulary's 248k
    tokens are what takes seconds."""
    config = AutoConfig.from_pretrained(model_dir)
    vocab_size, eos_ids = config.vocab_size, list(config.eos_token_id)  # the logits' width, the eos ids
    stop_ids = frozenset(eos_ids)
    grammars = Grammars(model_dir, vocab_size, eos_ids, tmp_path)
    reading = grammars.prepare()
    compiling = grammars.matcher_later(Grammars.parse("regex", REGEX), stop_ids)
    longest_wait, last = 0.0, time.perf_counter()
    while not compiling.done():
        time.sleep(0.01)
        now = time.perf_counter()
        longest_wait, last = max(longest_wait, now - last), now
    assert compiling.result().accept_string("abc-12") and longest_wait < 0.75, longest_wait
    assert reading.done() and len(list((tmp_path / "xgrammar").glob("vocabulary-*.json"))) == 1

    restarted = Grammars(model_dir, vocab_size, eos_ids, tmp_path)
    monkeypatch.setattr(restarted, "_read_vocabulary", lambda: pytest.fail("the kept vocabulary was read again"))
    restarted.prepare().result(timeout=60)
    assert restarted.matcher(Grammars.parse("regex", REGEX), stop_ids).accept_string("abc-12")
    # A kept file that xgrammar cannot read (damaged) is read again from the tokenizer, and replaced.
    [kept] = (tmp_path / "xgrammar").glob("vocabulary-*.json")
    good = kept.read_text()
    kept.write_text(good[: len(good) // 2])
    repaired = Grammars(model_dir, vocab_size, eos_ids, tmp_path)
    monkeypatch.setattr(repaired, "_read_vocabulary", lambda: good)
    repaired.prepare().result(timeout=60)
    assert repaired.matcher(Grammars.parse("regex", REGEX), stop_ids).accept_string("abc-12")
    assert kept.read_text() == good and not list((tmp_path / "xgrammar").glob("*.tmp"))
    # Other stop tokens make another vocabulary for xgrammar: not the one kept.
    other = VocabularyCache(tmp_path, model_dir, vocab_size, [*eos_ids, 0])
    assert other.read() is None


def test_an_abort_while_compiling_ends_it(run):
    ask(run, "constrained", regex=REGEX)
    run.step()
    run.engine.abort(AbortRequest(rid="constrained"))
    run.step()
    assert run.finish("constrained").reason is FinishReason.ABORT
    assert not run.engine.scheduler.requests
    run.grammars.go.set()  # the compile ends later: nothing is left to get in line
    run.step(3)
    assert not run.engine.scheduler.requests


def test_a_failed_compile_fails_that_request_alone(run):
    run.grammars.failure = RuntimeError("out of memory")
    ask(run, "constrained", regex=REGEX)
    ask(run, "free", ignore_eos=True)
    run.grammars.go.set()
    run.step(20)
    finish = run.finish("constrained")
    assert finish.reason is FinishReason.ERROR and "its grammar did not compile: out of memory" in finish.message
    assert run.finish("free").reason is FinishReason.LENGTH


def test_a_constraint_that_does_not_parse_is_refused_at_submit(run):
    with pytest.raises(InvalidTokenizedRequest, match="Unclosed"):
        ask(run, "bad", regex="[a-")


def test_a_compile_past_its_bound_fails_that_request_alone(runner, small_model_dir):
    """--grammar-compile-timeout-s: the engine wakes at the deadline by itself (no other request arrives)."""
    run = constrained_run(runner, small_model_dir, grammar_compile_timeout_s=2.0)
    try:
        ask(run, "constrained", regex=REGEX)
        ask(run, "free", ignore_eos=True)
        run.step()
        assert run.finish("constrained") is None
        run.step(20)
        assert run.finish("free").reason is FinishReason.LENGTH
        run.engine.step(block=True)  # nothing new comes: it waits until the deadline, then fails the request
        finish = run.finish("constrained")
        assert finish.reason is FinishReason.ERROR and "not compiled within 2 s" in finish.message
        assert not run.engine.scheduler.requests
    finally:
        run.grammars.go.set()
