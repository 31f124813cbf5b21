"""The detokenizer's step processing against the real default tokenizer (no services).

Steps are built as the scheduler sends them and fed to DetokenizerManager, then
routed with Router, exactly as the service does.
"""

import asyncio
import json
import random

import numpy as np
import pytest
from flatwire_wire.logprobs import LogprobBlock, LogprobRows
from flatwire_wire.steps import DetokenizeParams, Finish, FinishReason, RequestResume, RequestStart, StepMessage
from transformers import AutoTokenizer

from services.detokenizer.batch_decode import _rust_tokenizer, batch_decoder, load_batch_decoder
from services.detokenizer.decode_status import REPLACEMENT_CHAR
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.router import Router
from services.detokenizer.stop_strings import StopStrings

MULTIBYTE = "你好，世界！😀🎉 héllo wörld\n\n日本語のテキスト 👨‍👩‍👧 한국어 done"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


class CountingTokenizer:
    """The real tokenizer, counting batched decode calls (through transformers or straight to Rust)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces
        self._tokenizer = self  # the Rust backend's decode_batch, counted too
        self.calls = 0

    def batch_decode(self, sequences, **options):
        self.calls += 1
        return self.tokenizer.batch_decode(sequences, **options)

    def decode_batch(self, sequences, skip_special_tokens):
        self.calls += 1
        return self.tokenizer._tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)


def params(**fields) -> DetokenizeParams:
    return DetokenizeParams(**fields)


def run(manager, requests: dict[str, tuple[list[int], DetokenizeParams]],
        finish_reason=FinishReason.LENGTH, owner="gw"):
    """Stream every request one token per step, all in the same steps; returns (deltas, finishes, aborts).

    Each request ends with `finish_reason` on its last token; requests the detokenizer
    stopped keep arriving until then, as steps in flight do.
    """
    deltas = {rid: [] for rid in requests}
    finishes, aborts = {}, []
    for step in range(max(len(ids) for ids, _ in requests.values())):
        message = StepMessage(step=step)
        for rid, (ids, detokenize) in requests.items():
            if step == 0:
                message.started.append(RequestStart(rid=rid, owner=owner, detokenize=detokenize, prompt_tokens=3))
            if step < len(ids):
                message.rids.append(rid)
                message.token_ids.append(ids[step])
                message.positions.append(step)
                message.counts.append(1)
            if step == len(ids) - 1:
                message.finished.append(Finish(rid=rid, reason=finish_reason, matched_token=ids[step],
                                               output_tokens=len(ids)))
        owned, step_aborts = manager.process(message, "scheduler:1")
        aborts += step_aborts
        for index, rid in enumerate(message.rids):
            if owned.owners[index] is not None:
                deltas[rid].append(owned.texts[index])
        for _, finish in owned.finished:
            assert finish.rid not in finishes, "a request finished twice"
            finishes[finish.rid] = finish
    assert not manager.requests and not manager.stopped, "state left behind"
    return deltas, finishes, aborts


def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer):
    rng = random.Random(7)
    requests = {
        "multibyte": (tokenizer.encode(MULTIBYTE), params()),
        "words": (tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3), params()),
        **{f"noise{n}": ([rng.randrange(len(tokenizer)) for _ in range(40)], params()) for n in range(4)},
    }
    deltas, finishes, _ = run(DetokenizerManager(batch_decoder(tokenizer)), requests)
    for rid, (ids, _) in requests.items():
        assert "".join(deltas[rid]) == tokenizer.decode(ids), rid
        assert finishes[rid].reason == FinishReason.LENGTH
    assert "".join(deltas["multibyte"]) == MULTIBYTE


def test_characters_split_across_tokens_never_stream_replacement_chars(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "the text must split a character"
    deltas, _, _ = run(DetokenizerManager(batch_decoder(tokenizer)), {"r": (ids, params())})
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas["r"])
    assert "" in deltas["r"], "partial characters must be held back"


def test_one_step_decodes_all_its_requests_in_two_batched_calls(tokenizer):
    counting = CountingTokenizer(tokenizer)
    manager = DetokenizerManager(batch_decoder(counting))
    ids = tokenizer.encode("several requests share this step")
    run(manager, {f"r{n}": (ids, params(skip_special_tokens=True)) for n in range(5)})
    assert counting.calls == 2 * len(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_direct_rust_decode_equals_transformers_batch_decode(tokenizer, skip):
    sequences = [tokenizer.encode(text) + [248046, 248045] for text in ("plain words", "中文 🎉 mixed", "")]
    sequences.append([0xE4 - 0x21, 248044])  # a lone byte token, then a special token
    assert batch_decoder(tokenizer)(sequences, skip, True) == tokenizer.batch_decode(sequences,
                                                                                     skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_the_checkpoint_decoder_loaded_without_transformers_decodes_as_transformers(model_dir, tokenizer, skip,
                                                                                  tmp_path):
    sequences = [tokenizer.encode(text) + [248046, 248058, 248068] for text in ("plain words", "中文 🎉", "")]
    sequences.append(random.Random(7).sample(range(len(tokenizer)), 2000))  # ids all over the vocabulary
    expected = tokenizer.batch_decode(sequences, skip_special_tokens=skip)
    assert load_batch_decoder(model_dir, tmp_path)(sequences, skip, True) == expected  # writes the kept copy
    kept = list((tmp_path / "decoding-tokenizers").iterdir())
    assert [path.suffix for path in kept] == [".json"]
    assert json.loads(kept[0].read_bytes())["model"]["merges"] == []  # the part decoding never reads
    assert load_batch_decoder(model_dir, tmp_path)(sequences, skip, True) == expected  # reads it
    assert load_batch_decoder(model_dir, None)(sequences, skip, True) == expected  # keeps nothing
    assert _rust_tokenizer(model_dir, None) is not None  # the default model's tokenizer.json is enough


def test_the_kept_decoding_tokenizer_is_the_checkpoint_s_own(model_dir, tokenizer, tmp_path):
    """Keyed by tokenizer.json's content: another vocabulary beside it is not mistaken for it."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer_config.json").write_bytes((model_dir / "tokenizer_config.json").read_bytes())
    content = json.loads((model_dir / "tokenizer.json").read_bytes())
    first = next(token for token, i in content["model"]["vocab"].items() if i == 0)
    content["model"]["vocab"][first + "x"] = content["model"]["vocab"].pop(first)
    (other / "tokenizer.json").write_text(json.dumps(content))
    cache = tmp_path / "cache"
    assert load_batch_decoder(model_dir, cache)([[0]], False, True) == [tokenizer.decode([0])]
    assert load_batch_decoder(other, cache)([[0]], False, True) == [tokenizer.decode([0]) + "x"]
    assert len(list((cache / "decoding-tokenizers").iterdir())) == 2


def test_a_cache_directory_that_cannot_be_written_costs_only_the_copy(model_dir, tokenizer, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would be")
    assert load_batch_decoder(model_dir, blocked)([[0, 1]], False, True) == [tokenizer.decode([0, 1])]
    assert "could not keep the decoding tokenizer" in caplog.text


def test_a_checkpoint_whose_config_adds_special_tokens_decodes_through_transformers(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = [*config["extra_special_tokens"], "<think>"]  # not special in tokenizer.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert _rust_tokenizer(tmp_path, None) is None


def test_skip_special_tokens(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("hello") + [im_end] + tokenizer.encode(" world")
    deltas, _, _ = run(DetokenizerManager(batch_decoder(tokenizer)), {
        "skip": (ids, params(skip_special_tokens=True)),
        "keep": (ids, params(skip_special_tokens=False, spaces_between_special_tokens=True)),
    })
    assert "".join(deltas["skip"]) == "hello world"
    assert "".join(deltas["keep"]) == "hello<|im_end|> world"


def test_stop_token_is_not_text_unless_no_stop_trim(tokenizer):
    ids = tokenizer.encode("the end") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    deltas, finishes, aborts = run(DetokenizerManager(batch_decoder(tokenizer)), {
        "trim": (ids, params()), "keep": (ids, params(no_stop_trim=True)),
        "vllm": (ids, params(include_stop_str=True)),  # vLLM's include_stop_str_in_output keeps it too
    }, finish_reason=FinishReason.STOP_TOKEN)
    assert "".join(deltas["trim"]) == "the end"
    assert "".join(deltas["keep"]) == "".join(deltas["vllm"]) == "the end<|im_end|>"
    assert finishes["trim"].reason == FinishReason.STOP_TOKEN and not aborts


def test_stop_string_spanning_tokens_trims_and_stops_the_request(tokenizer):
    text = "Hello world, this is where we stop here and never go on"
    ids = tokenizer.encode(text)
    stop = "op he"  # "stop" and " here" are separate tokens
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    deltas, finishes, aborts = run(DetokenizerManager(batch_decoder(tokenizer)), {
        "trim": (ids, params(stop=["never", stop])),
        "keep": (ids, params(stop=[stop], no_stop_trim=True)),
        "vllm": (ids, params(stop=[stop], include_stop_str=True)),
    })
    assert "".join(deltas["trim"]) == "Hello world, this is where we st"
    # SGLang's no_stop_trim keeps the whole token the match ended in ("here"); vLLM's include_stop_str_in_output
    # cuts right after the matched string.
    assert "".join(deltas["keep"]) == "Hello world, this is where we stop here"
    assert "".join(deltas["vllm"]) == "Hello world, this is where we stop he"
    for rid in ("trim", "keep", "vllm"):
        assert finishes[rid].reason == FinishReason.STOP_STRING
        assert finishes[rid].matched_stop == stop
    assert sorted((a.rid, a.reason, a.matched_stop) for a in aborts) == [
        ("keep", FinishReason.STOP_STRING, stop), ("trim", FinishReason.STOP_STRING, stop),
        ("vllm", FinishReason.STOP_STRING, stop)]


def test_stop_string_in_the_last_token_overrides_length(tokenizer):
    ids = tokenizer.encode("one two three")
    deltas, finishes, aborts = run(DetokenizerManager(batch_decoder(tokenizer)), {"r": (ids, params(stop=[" three"]))})
    assert "".join(deltas["r"]) == "one two"
    assert finishes["r"].reason == FinishReason.STOP_STRING and not aborts


def test_stop_strings_first_match_and_partial_holdback():
    stops = StopStrings.of(["world", "", "lo w", "xyz"])
    assert stops.strings == ("world", "lo w", "xyz")
    match = stops.find("hello world", 0)
    assert (match.start, match.stop) == (3, "lo w")
    assert stops.find("hello world", len("hello ")) == match, "a match ending in the new tail is found"
    assert stops.find("hello world", len("hello world")) is None, "text searched before is not rescanned"
    assert stops.partial_len("say hi", 6) == 0
    assert stops.partial_len("say hello", 9) == 2
    assert stops.partial_len("say worl", 8) == 4
    assert stops.partial_len("say xy!", 6) == 2
    assert StopStrings.of(["world"], no_stop_trim=True).partial_len("worl", 4) == 0
    assert StopStrings.of(["world"], include_stop=True).partial_len("worl", 4) == 0  # nothing before it is cut
    through = StopStrings.of(["lo w"], include_stop=True)
    assert "hello world"[:through.text_end("hello world", through.find("hello world", 0))] == "hello w"


def _block(rows: int, k: int, seed: int) -> LogprobBlock:
    """`rows` requests of one row each."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, k)).astype("<f4")
    values[:, ::3] = -np.inf
    ids = rng.integers(0, 1000, (rows, k)).astype("<i4")
    return LogprobBlock.of_rows([LogprobRows(rng.standard_normal(1).astype("<f4"), values[i:i + 1], ids[i:i + 1],
                                             np.zeros((1, 0), "<f4")) for i in range(rows)])


def test_router_gives_each_owner_only_its_requests_with_their_bytes(tokenizer):
    async def scenario():
        manager, router = DetokenizerManager(batch_decoder(tokenizer)), Router(adopt_for_s=60)
        queues = {owner: router.subscribe(owner) for owner in ("gw-a", "gw-b")}
        token = tokenizer.encode(" fox")[0]
        owners = {"a1": "gw-a", "b1": "gw-b", "a2": "gw-a", "x1": "gw-gone"}
        step = StepMessage(step=1, rids=list(owners), token_ids=[token] * 4, positions=[0] * 4, counts=[1] * 4,
                           output=_block(4, 5, 1), prompt_rids=["b1", "a2"], prompt=_block(2, 3, 2))
        for rid, owner in owners.items():
            step.started.append(RequestStart(rid=rid, owner=owner, detokenize=params(), prompt_tokens=3))
        step.finished.append(Finish(rid="a2", reason=FinishReason.LENGTH, output_tokens=1))
        owned, _ = manager.process(step, "scheduler:1")
        router.publish(owned)
        output, prompt = step.output, step.prompt

        def joined(block, keep, name):
            return b"".join(getattr(block.request(i), name).tobytes() for i in keep)

        got = {owner: queue.get_nowait() for owner, queue in queues.items()}
        assert all(queue.empty() for queue in queues.values())
        for owner, keep, keep_prompt in (("gw-a", [0, 2], [1]), ("gw-b", [1], [0])):
            message = got[owner]
            assert list(message.rids) == [step.rids[i] for i in keep]
            assert [s.rid for s in message.started] == list(message.rids)
            assert list(message.texts) == [" fox"] * len(keep)
            assert list(message.prompt_rids) == [step.prompt_rids[i] for i in keep_prompt]
            assert [f.rid for f in message.finished] == (["a2"] if owner == "gw-a" else [])
            for name in ("token_logprobs", "topk_values", "topk_ids"):
                assert joined(message.output, range(len(keep)), name) == joined(output, keep, name)
                assert joined(message.prompt, range(len(keep_prompt)), name) == joined(prompt, keep_prompt, name)
        # The owner with no subscriber keeps being decoded, its outputs waiting for it to (re)connect.
        assert manager.requests["x1"].status.decode_ids == [token]
        assert list(router.subscribe("gw-gone").get_nowait().rids) == ["x1"]

    asyncio.run(scenario())


# -- positions: replays, gaps and resumes ------------------------------------------------------------------


def _steps(rid: str, ids: list[int], owner: str = "gw") -> list[StepMessage]:
    """One request streamed one token per step, as the scheduler sends it; LENGTH on the last."""
    steps = []
    for position, token in enumerate(ids):
        step = StepMessage(step=position + 1, rids=[rid], token_ids=[token], positions=[position], counts=[1])
        if position == 0:
            step.started.append(RequestStart(rid=rid, owner=owner, detokenize=params(), prompt_tokens=3))
        if position == len(ids) - 1:
            step.finished.append(Finish(rid=rid, reason=FinishReason.LENGTH, output_tokens=len(ids)))
        steps.append(step)
    return steps


def _feed(manager, steps) -> tuple[dict[int, str], list, list]:
    """Text per position, finishes and aborts the manager emitted for these steps."""
    texts, finishes, aborts = {}, [], []
    for step in steps:
        for part in manager.expand(step):
            owned, step_aborts = manager.process(part, "scheduler:1")
            aborts += step_aborts
            for index, owner in enumerate(owned.owners):
                if owner is not None:
                    assert part.positions[index] not in texts, "a position emitted twice"
                    texts[part.positions[index]] = owned.texts[index]
            finishes += [finish for _, finish in owned.finished]
    return texts, finishes, aborts


def test_replayed_steps_are_taken_once(tokenizer):
    steps = _steps("r", tokenizer.encode(MULTIBYTE))
    manager = DetokenizerManager(batch_decoder(tokenizer))
    texts, finishes, _ = _feed(manager, steps[:10])
    # The stream was cut and resubscribed: the scheduler replays steps 4.. again.
    more, finishes_after, _ = _feed(manager, steps[4:])
    assert sorted(texts) + sorted(more) == list(range(len(steps)))
    assert "".join(texts[p] for p in sorted(texts)) + "".join(more[p] for p in sorted(more)) == MULTIBYTE
    assert [f.output_tokens for f in finishes + finishes_after] == [len(steps)]


@pytest.mark.parametrize("resumed_at", [0, 1, 7, 20])
def test_a_resumed_request_gets_the_same_deltas_as_without_the_restart(tokenizer, resumed_at):
    ids = tokenizer.encode(MULTIBYTE)
    steps = _steps("r", ids)
    undisturbed, _, _ = _feed(DetokenizerManager(batch_decoder(tokenizer)), steps)
    # A new detokenizer: the scheduler resumes the request from its first resumed_at ids, then replays the rest.
    head = StepMessage()
    head.resumed.append(RequestResume(start=steps[0].started[0], output_ids=ids[:resumed_at]))
    resumed = steps[resumed_at]  # its start came with the resume:
    first = StepMessage(step=resumed.step, rids=resumed.rids, token_ids=resumed.token_ids, positions=resumed.positions,
                        counts=resumed.counts, finished=resumed.finished)
    restarted, finishes, _ = _feed(DetokenizerManager(batch_decoder(tokenizer)), [head, first, *steps[resumed_at + 1:]])
    assert restarted == undisturbed
    assert [f.reason for f in finishes] == [FinishReason.LENGTH]


def test_a_gap_fails_the_request_and_aborts_it(tokenizer):
    steps = _steps("r", tokenizer.encode("one two three four five six"))
    manager = DetokenizerManager(batch_decoder(tokenizer))
    texts, finishes, aborts = _feed(manager, [steps[0], steps[1], steps[3]])
    assert sorted(texts) == [0, 1]
    assert [(f.reason, f.output_tokens) for f in finishes] == [(FinishReason.ERROR, 2)]
    assert "2..2" in finishes[0].message
    assert [a.rid for a in aborts] == ["r"] and not manager.requests


def test_entries_of_several_tokens_decode_as_one_delta_and_route_whole(tokenizer):
    """Coalesced entries (a request that does not stream): one delta per entry, the same text in the end;
    the router gives each owner its entries' tokens, counts and positions."""
    async def scenario():
        manager, router = DetokenizerManager(batch_decoder(tokenizer)), Router(adopt_for_s=60)
        queues = {owner: router.subscribe(owner) for owner in ("gw-a", "gw-b")}
        ids = {"a": tokenizer.encode(MULTIBYTE), "b": tokenizer.encode("The quick brown fox jumps over the lazy dog.")}
        texts = {rid: "" for rid in ids}
        for position in range(0, max(map(len, ids.values())), 7):
            entries = {rid: seq[position:position + 7] for rid, seq in ids.items() if position < len(seq)}
            message = StepMessage(rids=list(entries), positions=[position] * len(entries),
                                  counts=[len(e) for e in entries.values()],
                                  token_ids=[t for e in entries.values() for t in e])
            if position == 0:
                for rid in ids:
                    message.started.append(RequestStart(rid=rid, owner=f"gw-{rid}", detokenize=params()))
            message.finished.extend(Finish(rid=rid, reason=FinishReason.LENGTH, output_tokens=len(ids[rid]))
                                    for rid in entries if position + 7 >= len(ids[rid]))
            owned, _ = manager.process(message, "scheduler:1")
            router.publish(owned)
        for rid in ids:
            queue = queues[f"gw-{rid}"]
            got = []
            while not queue.empty():
                part = queue.get_nowait()
                assert list(part.rids) == [rid] * len(part.rids)
                got += list(part.token_ids)
                assert sum(part.counts) == len(part.token_ids)
                texts[rid] += "".join(part.texts)
            assert got == ids[rid]
            assert texts[rid] == tokenizer.decode(ids[rid])

    asyncio.run(scenario())
