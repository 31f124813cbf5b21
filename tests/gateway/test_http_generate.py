"""SGLang-compatible POST /generate against the whole pipeline on loopback."""

import base64
import concurrent.futures
import itertools
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from harness.http import generate, stream_events

K = 5
PROMPT = "The quick brown fox jumps over the lazy dog. Flat arrays beat nested rows"
GREEDY = {"max_new_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def nested_topk(rows: list) -> tuple[np.ndarray, np.ndarray, int]:
    """Nested [logprob, id, text] rows -> ([n, k] f32 values, [n, k] i32 ids, leading null rows)."""
    nulls = next((i for i, row in enumerate(rows) if row is not None), len(rows))
    triples = np.array(rows[nulls:], dtype=object)
    return triples[:, :, 0].astype(np.float32), triples[:, :, 1].astype(np.int32), nulls


def flat_topk(meta: dict, side: str) -> tuple[np.ndarray, np.ndarray, int]:
    prefix = f"{side}_top_logprobs"
    shape = meta[f"{prefix}_shape"]
    if f"{prefix}_val_flat_b64" in meta:
        assert meta[f"{prefix}_val_flat_b64_dtype"] == "float32" and meta[f"{prefix}_idx_flat_b64_dtype"] == "int32"
        values = np.frombuffer(base64.b64decode(meta[f"{prefix}_val_flat_b64"]), dtype="<f4")
        ids = np.frombuffer(base64.b64decode(meta[f"{prefix}_idx_flat_b64"]), dtype="<i4")
    else:
        values = np.array(meta[f"{prefix}_val_flat"], dtype=np.float32)
        ids = np.array(meta[f"{prefix}_idx_flat"], dtype=np.int32)
    return values.reshape(shape), ids.reshape(shape), meta[f"{prefix}_null_prefix"]


def test_nested_flat_json_and_flat_b64_agree(http):
    common = dict(text=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                  top_logprobs_num=K)
    nested = generate(http, **common)["meta_info"]
    flat_json = generate(http, **common, return_flat_raw_top_logprobs=True,
                         return_flat_raw_output_top_logprobs=True)["meta_info"]
    flat_b64 = generate(http, **common, return_flat_raw_top_logprobs=True, return_flat_raw_output_top_logprobs=True,
                        return_flat_raw_top_logprobs_b64=True)["meta_info"]
    assert "output_top_logprobs" not in flat_b64 and "output_top_logprobs_val_flat" not in flat_b64
    for side, rows in (("input", nested["prompt_tokens"] - 1), ("output", GREEDY["max_new_tokens"])):
        values, ids, nulls = nested_topk(nested[f"{side}_top_logprobs"])
        assert values.shape == (rows, K)
        assert nulls == (1 if side == "input" else 0)
        assert (np.diff(values, axis=1) <= 0).all()  # best first
        for meta in (flat_json, flat_b64):
            flat_values, flat_ids, flat_nulls = flat_topk(meta, side)
            assert flat_nulls == nulls
            np.testing.assert_array_equal(flat_ids, ids)
            np.testing.assert_array_equal(flat_values, values)  # float32-exact
        # The sampled (greedy) token is the best candidate, and its logprob is the same number.
        if side == "output":
            selected = np.array(nested["output_token_logprobs"], dtype=object)
            np.testing.assert_array_equal(selected[:, 1].astype(np.int32), ids[:, 0])
            np.testing.assert_array_equal(selected[:, 0].astype(np.float32), values[:, 0])


def test_mixed_sides_and_token_ids_logprob(http, tokenizer):
    ids = [1, 2, 3]
    body = generate(http, text=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                    top_logprobs_num=K, token_ids_logprob=ids, return_text_in_logprobs=True,
                    return_flat_raw_top_logprobs=True, return_flat_raw_top_logprobs_b64=True)
    meta = body["meta_info"]
    assert "input_top_logprobs_val_flat_b64" in meta and "input_top_logprobs" not in meta
    output_rows = meta["output_top_logprobs"]  # the output side stays nested
    assert len(output_rows) == len(body["output_ids"]) == meta["completion_tokens"]
    assert output_rows[0][0][2] == tokenizer.decode([output_rows[0][0][1]])  # text in the triples
    assert [len(row) for row in meta["output_token_ids_logprobs"]] == [len(ids)] * len(output_rows)
    assert [entry[1] for entry in meta["output_token_ids_logprobs"][0]] == ids
    assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has no logprob


def test_finish_reason_and_counts(http, tokenizer):
    body = generate(http, text=PROMPT, sampling_params=GREEDY)
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert meta["completion_tokens"] == len(body["output_ids"]) == GREEDY["max_new_tokens"]
    assert meta["e2e_latency"] > 0 and meta["id"]
    by_ids = generate(http, input_ids=tokenizer.encode(PROMPT), sampling_params=GREEDY)
    assert by_ids["output_ids"] == body["output_ids"] and by_ids["text"] == body["text"]


def test_stream_matches_non_stream(http):
    common = dict(text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 24}, return_logprob=True,
                  top_logprobs_num=K)
    whole = generate(http, **common)
    events = stream_events(http, **common)
    assert len(events) > 1
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    # SGLang streams cumulatively: every event carries the text and ids so far.
    assert all(later["text"].startswith(earlier["text"]) for earlier, later in zip(events, events[1:]))
    assert last["text"] == whole["text"]
    assert last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert last["meta_info"]["output_top_logprobs"] == whole["meta_info"]["output_top_logprobs"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("b64", [True, False], ids=["flat b64", "flat JSON"])
def test_streamed_flat_top_k_deltas_concatenate_to_the_whole_response(http, b64):
    """Streaming with the flat flags: each event carries only its own output rows (shape [new rows, k], offset
    of the first), the flat prompt arrays come once, in the first event; concatenated, the arrays are the
    non-streamed response's, bit for bit."""
    common = dict(text=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                  top_logprobs_num=K, return_flat_raw_top_logprobs=True, return_flat_raw_output_top_logprobs=True,
                  return_flat_raw_top_logprobs_b64=b64)
    whole = generate(http, **common)["meta_info"]
    events = [event["meta_info"] for event in stream_events(http, **common)]
    with_rows = [meta for meta in events if "output_top_logprobs_shape" in meta]
    # A token per event, or several in one when the gateway runs behind (stream coalescing): either way each event's
    # offset is the count of the rows before it.
    rows = [meta["output_top_logprobs_shape"][0] for meta in with_rows]
    assert all(meta["output_top_logprobs_shape"] == [n, K] and n > 0 for meta, n in zip(with_rows, rows))
    offsets = list(itertools.accumulate(rows, initial=0))[:-1]
    assert [meta["output_top_logprobs_offset"] for meta in with_rows] == offsets
    assert sum(rows) == GREEDY["max_new_tokens"]
    values, ids = (np.concatenate(part) for part in zip(*(flat_topk(meta, "output")[:2] for meta in with_rows)))
    whole_values, whole_ids, _ = flat_topk(whole, "output")
    assert values.tobytes() == whole_values.tobytes() and ids.tobytes() == whole_ids.tobytes()
    prompt_events = [meta for meta in events if "input_top_logprobs_shape" in meta]
    assert prompt_events == [events[0]]  # once, first
    for got, want in zip(flat_topk(events[0], "input"), flat_topk(whole, "input")):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert events[-1]["output_token_logprobs"] == whole["output_token_logprobs"]  # still cumulative


def test_streamed_text_decodes_like_the_tokenizer(http, tokenizer):
    """Chunks never split a character: the streamed text is the decode of all output ids."""
    prompt = "日本語のテキストと絵文字 🦊🚀 も大丈夫？ 中文也可以。"
    events = stream_events(http, text=prompt, sampling_params={"max_new_tokens": 48, "temperature": 0})
    last = events[-1]
    assert last["text"] == tokenizer.decode(last["output_ids"], skip_special_tokens=True)
    assert last["meta_info"]["prompt_tokens"] == len(tokenizer.encode(prompt))
    # the prompt round-trips through the tokenizer the gateway uses, no replacement characters
    body = generate(http, text=prompt, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                    logprob_start_len=0, return_text_in_logprobs=True)
    prompt_ids = [entry[1] for entry in body["meta_info"]["input_token_logprobs"]]
    assert tokenizer.decode(prompt_ids) == prompt


def test_stop_string_trims(http):
    sampling = {**GREEDY, "max_new_tokens": 24}
    full = generate(http, text=PROMPT, sampling_params=sampling)["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick another stop in {full!r}"
    cut = full.index(stop)
    trimmed = generate(http, text=PROMPT, sampling_params={**sampling, "stop": [stop]})
    assert trimmed["text"] == full[:cut]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = generate(http, text=PROMPT, sampling_params={**sampling, "stop": stop, "no_stop_trim": True})
    assert kept["text"].startswith(full[:cut] + stop)
    streamed = stream_events(http, text=PROMPT, sampling_params={**sampling, "stop": [stop]})
    assert streamed[-1]["text"] == full[:cut]


def test_stop_token_ids(http):
    full = generate(http, text=PROMPT, sampling_params=GREEDY)["output_ids"]
    stop_id = full[3]
    body = generate(http, text=PROMPT, sampling_params={**GREEDY, "stop_token_ids": [stop_id]})
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert body["output_ids"] == full[:full.index(stop_id) + 1]
    # As SGLang: ignore_eos ignores stop_token_ids too, and runs to max_new_tokens.
    ignoring = generate(http, text=PROMPT, sampling_params={**GREEDY, "stop_token_ids": [stop_id], "ignore_eos": True})
    assert ignoring["output_ids"] == full and ignoring["meta_info"]["finish_reason"]["type"] == "length"


def test_batch(http, tokenizer):
    prompts = [PROMPT, "Bonjour, le monde"]
    sampling = [{**GREEDY, "max_new_tokens": 3}, {**GREEDY, "max_new_tokens": 5}]
    bodies = http.post("/generate", json={"text": prompts, "sampling_params": sampling}).json()
    assert [b["meta_info"]["completion_tokens"] for b in bodies] == [3, 5]
    singles = [generate(http, text=p, sampling_params=s) for p, s in zip(prompts, sampling)]
    assert [b["output_ids"] for b in bodies] == [s["output_ids"] for s in singles]
    by_ids = http.post("/generate", json={"input_ids": [tokenizer.encode(p) for p in prompts],
                                          "sampling_params": sampling[0]}).json()
    assert [b["meta_info"]["completion_tokens"] for b in by_ids] == [3, 3]
    events = stream_events(http, text=prompts, sampling_params=sampling)
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert [finals[i]["output_ids"] for i in range(2)] == [s["output_ids"] for s in singles]


def test_batch_logprob_fields_per_prompt(http):
    """SGLang's per-prompt lists of return_logprob, top_logprobs_num, logprob_start_len and token_ids_logprob."""
    body = {"text": [PROMPT, "Another"], "sampling_params": {**GREEDY, "max_new_tokens": 3},
            "return_logprob": [True, True], "top_logprobs_num": [2, 0], "logprob_start_len": [0, -1],
            "token_ids_logprob": [[1], [2, 3]]}
    first, second = http.post("/generate", json=body).json()
    assert [len(row) for row in first["meta_info"]["output_top_logprobs"]] == [2, 2, 2]
    assert first["meta_info"]["input_token_logprobs"] and not second["meta_info"]["input_token_logprobs"]
    assert [len(row) for row in second["meta_info"]["output_token_ids_logprobs"]] == [2, 2, 2]
    mixed = http.post("/generate", json={**body, "return_logprob": [False, True]}).json()
    assert "output_token_logprobs" not in mixed[0]["meta_info"] and mixed[1]["meta_info"]["output_token_logprobs"]
    events = stream_events(http, **{**body, "return_logprob": [False, True]})
    last = {e["index"]: e["meta_info"] for e in events if e["meta_info"]["finish_reason"] is not None}
    assert "output_token_logprobs" not in last[0] and len(last[1]["output_token_logprobs"]) == 3
    for field, value in (("top_logprobs_num", [2]), ("return_logprob", [True, True, True])):
        refused = http.post("/generate", json={**body, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    single = http.post("/generate", json={"text": PROMPT, "return_logprob": [True]})
    assert single.status_code == 400 and single.json()["error"]["param"] == "return_logprob"
    late = http.post("/generate", json={**body, "logprob_start_len": [0, 99]})
    assert late.status_code == 400 and late.json()["error"]["param"] == "logprob_start_len[1]"


def test_concurrent_requests_are_independent(http):
    """Greedy outputs don't depend on what else is batched with them."""
    alone = generate(http, text=PROMPT, sampling_params=GREEDY)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, http, text=PROMPT, sampling_params=GREEDY) for _ in range(4)]
        together = [f.result() for f in futures]
    assert all(body["output_ids"] == alone["output_ids"] for body in together)


def test_the_client_rid_names_the_request(http):
    """SGLang's rid: meta_info.id is the client's id (one per prompt of a batch); refused with 400 naming rid
    when it does not match the prompts, repeats within a batch, or names a request still running."""
    body = {"sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    meta = generate(http, text=PROMPT, rid="my-request-1", **body)["meta_info"]
    assert meta["id"] == "my-request-1"
    batch = generate(http, text=[PROMPT, "Another"], rid=["a-1", "a-2"], **body)
    assert [item["meta_info"]["id"] for item in batch] == ["a-1", "a-2"]
    named = generate(http, text=[PROMPT, "Another"], rid="b", **body)  # one string for a batch: SGLang's b_i
    assert [result["meta_info"]["id"] for result in named] == ["b_0", "b_1"]
    for rid, text in ((["a", "a"], [PROMPT, PROMPT]), (["x"], PROMPT), ("", PROMPT), ("", [PROMPT, PROMPT])):
        refused = http.post("/generate", json={"text": text, "rid": rid, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "rid", (rid, refused.text)
    # The stream asks for all that the context leaves, and runs until it is aborted: its last event says so, proof
    # that it was running while the second request was answered (400 tokens could end first, freeing the rid).
    longest = http.get("/get_server_info").json()["context_length"] - meta["prompt_tokens"]
    with http.stream("POST", "/generate", json={"text": PROMPT, "rid": "busy", "stream": True, "sampling_params": {
            "max_new_tokens": longest, "ignore_eos": True}}) as s:
        lines = s.iter_lines()
        next(lines)  # running
        again = http.post("/generate", json={"text": PROMPT, "rid": "busy", **body})
        assert again.status_code == 400 and again.json()["error"]["param"] == "rid"
        assert http.post("/abort_request", json={"rid": "busy"}).status_code == 200
        last = json.loads([line for line in lines if line.startswith("data: {")][-1].removeprefix("data: "))
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    assert last["meta_info"]["completion_tokens"] < longest
