"""The overlap schedule (--enable-overlap-schedule): a step's output is built and published after the next step
is launched, and the engine's outputs are those of the plain schedule: greedy tokens and logprobs equal
transformers' across chunked prompts, prefix hits, preemption and an abort that comes while a step is in flight."""

from flatwire_wire.scheduler import AbortRequest
from flatwire_wire.steps import FinishReason

from tests.scheduler.engine_run import Run, check, prompt


def test_outputs_equal_transformers_with_overlap(gqa):
    path, reference_model = gqa
    shared = prompt(5, 13)
    chunked = {f"r{n}": (prompt(n, 3 + 4 * n), 10, 0 if n % 2 else -1) for n in range(4)}
    chunked |= {"shared-a": (shared, 8, -1), "shared-b": (shared + prompt(6, 3), 8, -1)}
    preempted = {f"p{n}": (prompt(20 + n, 6 + 4 * n), 14, -1) for n in range(4)}  # 12 pages of 4 tokens: retracts
    for options, cases in (({"chunked_prefill_size": 5}, chunked), ({"max_total_tokens": 48}, preempted)):
        run = Run(path, enable_overlap_schedule=True, **options)
        for rid, (ids, new_tokens, start) in cases.items():
            run.submit(rid, ids, new_tokens, start, stream_interval=1)
        run.run()
        for rid, (ids, new_tokens, start) in cases.items():
            check(reference_model, ids, new_tokens, run.result(rid), start)
        assert run.engine.stats.retractions >= (1 if cases is preempted else 0)
        assert run.engine.stats.cached_prompt_tokens > 0 or cases is preempted


def test_a_steps_message_is_published_after_the_next_step_launches(gqa_model):
    run = Run(gqa_model, enable_overlap_schedule=True, own_runner=True)
    events: list[str] = []
    launch = run.runner.launch
    publish = run.engine.publish

    def launching(batch):
        events.append(f"launch {sum(row.end - row.start for row in batch.rows)}")
        return launch(batch)

    def publishing(message):
        events.append(f"publish {sum(len(message.entry_tokens(i)) for i in range(len(message.rids)))}")
        publish(message)

    run.runner.launch, run.engine.publish = launching, publishing
    run.submit("a", prompt(1, 6), 3, stream_interval=1)
    run.run()
    # The prefill is launched and the request announced; each later pass lands a step, launches the next and
    # then publishes the landed step's token; the last lands alone.
    assert events == ["launch 6", "publish 0", "launch 1", "publish 1", "launch 1", "publish 1", "publish 1"], events
    assert run.result("a")["tokens"] == plain_tokens(gqa_model, "a", prompt(1, 6), 3)


def plain_tokens(path, rid: str, ids: list[int], new_tokens: int) -> list[int]:
    """The tokens the plain schedule gives the request alone."""
    plain = Run(path)
    plain.submit(rid, ids, new_tokens)
    plain.run()
    return plain.result(rid)["tokens"]


def test_an_abort_while_a_step_is_in_flight_lands_it_first(gqa_model):
    run = Run(gqa_model, enable_overlap_schedule=True)
    run.submit("kept", prompt(2, 7), 6)
    run.submit("aborted", prompt(3, 7), 50)
    run.step(4)  # prefill, then decodes: one step in flight after each pass
    assert run.engine._in_flight is not None
    run.engine.abort(AbortRequest(rid="aborted"))
    run.run()
    aborted = run.result("aborted")
    assert aborted["finish"].reason is FinishReason.ABORT
    assert len(aborted["tokens"]) == 4  # the four landed steps' tokens, none lost, none invented
    assert aborted["tokens"] == plain_tokens(gqa_model, "aborted", prompt(3, 7), 50)[:4]
    assert run.result("kept")["tokens"] == plain_tokens(gqa_model, "kept", prompt(2, 7), 6)
