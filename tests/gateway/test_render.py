"""The gateway's response renderers and token table, in process (they are pure functions).

One synthetic Output (a request's whole output), with a prompt side (null prefix), -inf candidates, byte
tokens that are half a UTF-8 character and candidates whose texts collide, is rendered
in every format; each rendering is serialized, parsed back as a client would, and
decoded to the same [rows, k] ids and float32 logprobs.
"""

import codecs

import numpy as np
import orjson
import pybase64
import pytest
from flatwire_wire.logprobs import F32, I32, RequestLogprobs
from transformers.convert_slow_tokenizer import bytes_to_unicode

from services.gateway.render import (
    LogprobFormat,
    chat_logprobs,
    completion_logprobs,
    dumps,
    logprob_meta_info,
    sglang_nested,
)
from services.gateway.reply import Output
from services.gateway.token_table import TokenTable

K = 6
TOKEN_IDS_LOGPROB = [11, 99986]


@pytest.fixture(scope="module")
def table(model_dir) -> TokenTable:
    return TokenTable.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def byte_ids(table) -> dict[int, int]:
    """Byte value -> id of the byte-level token holding that single byte."""
    spelled = bytes_to_unicode()
    return {byte: table.tokenizer.convert_tokens_to_ids(spelled[byte]) for byte in (0xE4, 0xE5, 0xB8)}


def _track(rng, rows: int, ids_pool: np.ndarray, null_prefix: int = 0) -> RequestLogprobs:
    values = -np.sort(rng.exponential(2.0, (rows, K)).astype(F32), axis=1)
    values.flat[rng.choice(values.size, 3, replace=False)] = -np.inf
    # Values with nine significant digits: the float32 text must not be rounded short.
    values[:, 1] = np.nextafter(values[:, 1], np.float32(0))
    ids = rng.choice(ids_pool, (rows, K)).astype(I32)
    return RequestLogprobs(
        token_ids=ids[:, 0].copy(),
        token_logprobs=values[:, 0].copy(),
        topk_values=values,
        topk_ids=ids,
        ids_logprobs=-rng.random((rows, len(TOKEN_IDS_LOGPROB))).astype(F32),
        null_prefix=null_prefix,
        null_token_ids=rng.choice(ids_pool, null_prefix).astype(I32),
    )


@pytest.fixture(scope="module")
def result(table, byte_ids) -> Output:
    rng = np.random.default_rng(7)
    pool = np.concatenate([rng.integers(0, table.size, 40), list(byte_ids.values()), [248046]]).astype(I32)
    output = _track(rng, 9, pool)
    # Two byte tokens whose text is the same "\ufffd", side by side in one row.
    output.topk_ids[2, 3:5] = [byte_ids[0xE4], byte_ids[0xE5]]
    output.topk_values[2, 3:5] = [-1.5, -2.25]
    output.token_ids[4] = output.topk_ids[4, 0] = byte_ids[0xE4]
    output.topk_values[5, 2] = -np.inf
    prompt = _track(rng, 4, pool, null_prefix=1)
    return Output(token_ids=output.token_ids.tolist(), text="", output=output, prompt=prompt,
                  token_ids_logprob=TOKEN_IDS_LOGPROB)


def _client(rendered) -> dict:
    """What a client sees: the rendering serialized, then parsed."""
    return orjson.loads(dumps(rendered))


def _floats(values) -> np.ndarray:
    """JSON numbers back to float32, null as -inf."""
    return np.array([-np.inf if v is None else v for v in values], dtype=np.float64).astype(F32)


def _same_f32(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert actual.view(np.uint32).tolist() == expected.astype(F32).view(np.uint32).tolist()


def _from_nested(rows: list, null_prefix: int) -> tuple[np.ndarray, np.ndarray]:
    assert rows[:null_prefix] == [None] * null_prefix
    triples = [t for row in rows[null_prefix:] for t in row]
    shape = (len(rows) - null_prefix, -1)
    return _floats([t[0] for t in triples]).reshape(shape), np.array([t[1] for t in triples], I32).reshape(shape)


def _from_flat(meta: dict, side: str) -> tuple[np.ndarray, np.ndarray, int]:
    prefix = f"{side}_top_logprobs"
    shape = meta[f"{prefix}_shape"]
    if f"{prefix}_val_flat_b64" in meta:
        assert meta[f"{prefix}_val_flat_b64_dtype"] == "float32" and meta[f"{prefix}_idx_flat_b64_dtype"] == "int32"
        values = np.frombuffer(pybase64.b64decode(meta[f"{prefix}_val_flat_b64"]), F32)
        ids = np.frombuffer(pybase64.b64decode(meta[f"{prefix}_idx_flat_b64"]), I32)
    else:
        values, ids = _floats(meta[f"{prefix}_val_flat"]), np.array(meta[f"{prefix}_idx_flat"], I32)
    return values.reshape(shape), ids.reshape(shape), meta[f"{prefix}_null_prefix"]


FLAT_FORMATS = {
    "flat JSON": LogprobFormat(return_flat_raw_top_logprobs=True, return_flat_raw_output_top_logprobs=True),
    "flat base64": LogprobFormat(return_flat_raw_top_logprobs=True, return_flat_raw_output_top_logprobs=True,
                                 return_flat_raw_top_logprobs_b64=True),
}


@pytest.mark.parametrize("side", ["input", "output"])
def test_every_format_decodes_to_the_same_arrays(result, table, side):
    track = result.prompt if side == "input" else result.output
    decoded = {}
    for with_text in (False, True):
        meta = _client(logprob_meta_info(result, LogprobFormat(return_text_in_logprobs=with_text), table))
        decoded[f"nested text={with_text}"] = (*_from_nested(meta[f"{side}_top_logprobs"], track.null_prefix),
                                               track.null_prefix)
    for name, fmt in FLAT_FORMATS.items():
        decoded[name] = _from_flat(_client(logprob_meta_info(result, fmt, table)), side)
    for name, (values, ids, null_prefix) in decoded.items():
        _same_f32(values, track.topk_values)
        assert ids.tolist() == track.topk_ids.tolist(), name
        assert null_prefix == track.null_prefix, name
    if side == "output":
        content = _client(chat_logprobs(track, table))["content"]
        candidates = [c for entry in content for c in entry["top_logprobs"]]
        _same_f32(_floats([c["logprob"] for c in candidates]).reshape(track.topk_values.shape), track.topk_values)
        assert [c["bytes"] for c in candidates] == [list(b) for b in table.token_bytes[track.topk_ids.ravel()]]


def test_minus_inf_is_null_in_json_and_kept_in_base64(result, table):
    output = result.output
    assert np.isneginf(output.topk_values).any() and np.isneginf(output.topk_values[5, 2])
    json_meta = _client(logprob_meta_info(result, FLAT_FORMATS["flat JSON"], table))
    assert json_meta["output_top_logprobs_val_flat"][5 * K + 2] is None
    nested = _client(logprob_meta_info(result, LogprobFormat(), table))
    assert nested["output_top_logprobs"][5][2][0] is None
    chat = _client(chat_logprobs(output, table))
    assert chat["content"][5]["top_logprobs"][2]["logprob"] is None
    b64_values, _, _ = _from_flat(_client(logprob_meta_info(result, FLAT_FORMATS["flat base64"], table)), "output")
    assert np.isneginf(b64_values[5, 2]) and np.isneginf(b64_values).sum() == np.isneginf(output.topk_values).sum()


def test_token_logprobs_with_null_prefix_and_text(result, table):
    meta = _client(logprob_meta_info(result, LogprobFormat(return_text_in_logprobs=True), table))
    prompt = result.prompt
    first = meta["input_token_logprobs"][0]
    assert first == [None, int(prompt.null_token_ids[0]), table.tokenizer.decode([int(prompt.null_token_ids[0])])]
    rows = meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]
    expected_ids = np.concatenate([prompt.token_ids, result.output.token_ids])
    assert [row[1] for row in rows] == expected_ids.tolist()
    assert [row[2] for row in rows] == [table.tokenizer.decode([int(i)]) for i in expected_ids]
    _same_f32(_floats([row[0] for row in rows]), np.concatenate([prompt.token_logprobs, result.output.token_logprobs]))
    top_triple = meta["output_top_logprobs"][0][0]
    assert top_triple[2] == table.tokenizer.decode([top_triple[1]])
    plain = _client(logprob_meta_info(result, LogprobFormat(), table))
    assert {row[2] for row in plain["output_token_logprobs"]} == {None}


@pytest.mark.parametrize("with_text", [False, True])
def test_few_token_rows_render_as_the_rows_of_many(table, byte_ids, with_text):
    """A streamed event's few rows (joined in Python) are the same JSON as those rows of a long output (the
    grid), -inf and byte tokens included."""
    rng = np.random.default_rng(3)
    pool = np.concatenate([rng.integers(0, table.size, 40), list(byte_ids.values())]).astype(I32)
    many = _track(rng, sglang_nested.FEW_ROWS + 8, pool)
    many.token_logprobs[[1, 5]] = -np.inf
    whole = orjson.loads(orjson.dumps(sglang_nested.token_logprobs(many, table, with_text)))
    for start, end in ((0, 1), (3, 7), (0, sglang_nested.FEW_ROWS)):
        few = many.view(start, end, many.token_ids[start:end])
        assert orjson.loads(orjson.dumps(sglang_nested.token_logprobs(few, table, with_text))) == whole[start:end]


def test_token_ids_logprobs(result, table):
    meta = _client(logprob_meta_info(result, LogprobFormat(), table))
    values, ids = _from_nested(meta["input_token_ids_logprobs"], result.prompt.null_prefix)
    _same_f32(values, result.prompt.ids_logprobs)
    assert ids.tolist() == [TOKEN_IDS_LOGPROB] * len(result.prompt.token_ids)
    values, ids = _from_nested(meta["output_token_ids_logprobs"], 0)
    _same_f32(values, result.output.ids_logprobs)


def test_fields_follow_the_flags(result, table):
    nested = _client(logprob_meta_info(result, LogprobFormat(), table))
    assert "output_top_logprobs" in nested and not any("_flat" in key for key in nested)
    output_b64 = _client(logprob_meta_info(result, LogprobFormat(return_flat_raw_output_top_logprobs=True,
                                                                  return_flat_raw_top_logprobs_b64=True), table))
    assert "input_top_logprobs" in output_b64 and "input_top_logprobs_shape" not in output_b64
    assert "output_top_logprobs" not in output_b64 and "output_top_logprobs_val_flat" not in output_b64
    assert output_b64["output_top_logprobs_shape"] == [9, K] and output_b64["output_top_logprobs_null_prefix"] == 0
    no_prompt = Output(token_ids=[], text="", output=result.output)
    meta = _client(logprob_meta_info(no_prompt, FLAT_FORMATS["flat JSON"], table))
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs_shape"] == [0, K]
    assert "output_token_ids_logprobs" not in meta
    assert logprob_meta_info(Output([], ""), LogprobFormat(), table) == {}


def test_json_floats_parse_back_to_the_same_float32(table):
    bits = np.random.default_rng(3).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(F32)
    values = values[np.isfinite(values)][:20_000].reshape(-1, 4)
    track = RequestLogprobs(token_ids=np.zeros(len(values), I32), token_logprobs=values[:, 0].copy(),
                            topk_values=values, topk_ids=np.zeros(values.shape, I32),
                            ids_logprobs=np.zeros((len(values), 0), F32))
    result = Output([], "", output=track)
    json_meta = _client(logprob_meta_info(result, LogprobFormat(return_flat_raw_output_top_logprobs=True), table))
    _same_f32(_floats(json_meta["output_top_logprobs_val_flat"]).reshape(values.shape), values)
    nested = _client(logprob_meta_info(result, LogprobFormat(), table))
    _same_f32(_from_nested(nested["output_top_logprobs"], 0)[0], values)


def test_chat_keeps_colliding_texts_and_raw_bytes(result, table, byte_ids):
    content = _client(chat_logprobs(result.output, table))["content"]
    collided = content[2]["top_logprobs"][3:5]
    assert [c["token"] for c in collided] == ["\ufffd", "\ufffd"]
    assert [c["bytes"] for c in collided] == [[0xE4], [0xE5]]  # each token's own byte, not U+FFFD's UTF-8
    assert content[4]["token"] == "\ufffd" and content[4]["bytes"] == [0xE4]
    assert len(content) == 9 and all(len(entry["top_logprobs"]) == K for entry in content)
    _same_f32(_floats([entry["logprob"] for entry in content]), result.output.token_logprobs)


def test_chat_without_candidates_keeps_selected_logprobs(result, table):
    content = _client(chat_logprobs(result.output, table, candidates=False))["content"]
    assert [entry["top_logprobs"] for entry in content] == [[]] * 9
    _same_f32(_floats([entry["logprob"] for entry in content]), result.output.token_logprobs)
    stream_chunk = result.output.view(3, 5, result.output.token_ids[3:5])
    chunk = _client(chat_logprobs(stream_chunk, table))["content"]
    assert chunk == _client(chat_logprobs(result.output, table))["content"][3:5]


def test_completions_echo_offsets_and_best_of_colliding_texts(result, table):
    prompt, output = result.prompt, result.output
    logprobs = _client(completion_logprobs([prompt, output], table, text_offset=3))
    ids = np.concatenate([prompt.null_token_ids, prompt.token_ids, output.token_ids])
    texts = [table.tokenizer.decode([int(i)]) for i in ids]
    assert logprobs["tokens"] == texts
    # Offsets in the text as it grows: a byte token that ends inside a character adds nothing until it is complete.
    pieces = [table.token_bytes[i] for i in ids]
    assert logprobs["text_offset"] == [3 + len(_decoded_so_far(b"".join(pieces[:i]))) for i in range(len(ids))]
    assert logprobs["token_logprobs"][0] is None
    _same_f32(_floats(logprobs["token_logprobs"][1:]), np.concatenate([prompt.token_logprobs, output.token_logprobs]))
    top = logprobs["top_logprobs"]
    assert top[0] is None and len(top) == len(ids)
    row = top[prompt.null_prefix + len(prompt.token_ids) + 2]  # output row 2: two "\ufffd" candidates
    assert row["\ufffd"] == -1.5 and len(row) == len({table.texts[i] for i in output.topk_ids[2]})
    for values, ids_row, rendered in zip(output.topk_values, output.topk_ids, top[-len(output.token_ids):]):
        expected = {}
        for value, token_id in zip(values, ids_row):
            expected.setdefault(table.texts[token_id], None if np.isneginf(value) else float(value))
        assert rendered.keys() == expected.keys()


def test_empty_tracks_render(table):
    empty = RequestLogprobs.empty(K, 0)
    result = Output([], "", output=empty)
    for fmt in [LogprobFormat(), *FLAT_FORMATS.values()]:
        meta = _client(logprob_meta_info(result, fmt, table))
        assert meta["output_token_logprobs"] == []
    assert _client(chat_logprobs(empty, table)) == {"content": []}
    assert _client(completion_logprobs([empty], table)) == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                            "text_offset": []}


def _decoded_so_far(data: bytes) -> str:
    """The text of these bytes, a character they end inside of held back (as a detokenizer holds it)."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data)


def _plain(ids: np.ndarray) -> RequestLogprobs:
    """Output rows of these tokens, without candidates."""
    rows = len(ids)
    return RequestLogprobs(token_ids=ids, token_logprobs=np.zeros(rows, F32), topk_values=np.zeros((rows, 0), F32),
                           topk_ids=np.zeros((rows, 0), I32), ids_logprobs=np.zeros((rows, 0), F32),
                           null_prefix=0, null_token_ids=np.zeros(0, I32))


def test_completions_offsets_count_characters_split_over_byte_tokens(table):
    spelled = bytes_to_unicode()
    split = [table.tokenizer.convert_tokens_to_ids(spelled[byte]) for byte in "日本".encode()]  # 2 x 3 bytes
    ab = table.tokenizer.encode("ab")
    ids = np.array(split + ab, dtype=I32)
    offsets = _client(completion_logprobs([_plain(ids)], table))["text_offset"]
    assert offsets == [0, 0, 0, 1, 1, 1, 2, 2 + len(table.texts[ab[0]])][:len(ids)]  # "ab": one or two tokens
    # A stream's chunk that starts inside a character its previous chunk began: the character counts once.
    chunk = np.array(split[1:3] + ab[:1], dtype=I32)
    assert _client(completion_logprobs([_plain(chunk)], table, text_offset=5))["text_offset"] == [5, 5, 6]


def test_completions_top_logprobs_hold_the_rows_own_token(table, result):
    """OpenAI: the sampled (or echoed) token is always among top_logprobs, so a row has up to logprobs + 1
    entries; logprobs=0 gives the token alone."""
    output = result.output
    track = _plain(output.token_ids.copy())
    track.token_logprobs[:] = -0.5
    alone = _client(completion_logprobs([track], table))["top_logprobs"]
    assert alone == [{table.texts[i]: -0.5} for i in output.token_ids]
    other = RequestLogprobs(token_ids=output.topk_ids[:, -1].copy(), token_logprobs=output.topk_values[:, -1].copy(),
                            topk_values=output.topk_values[:, :2], topk_ids=output.topk_ids[:, :2],
                            ids_logprobs=output.ids_logprobs, null_prefix=0, null_token_ids=np.zeros(0, I32))
    for row, own, candidates in zip(_client(completion_logprobs([other], table))["top_logprobs"], other.token_ids,
                                    other.topk_ids):
        assert table.texts[own] in row and len(row) == len({table.texts[i] for i in [*candidates, own]})


def test_token_table_matches_the_tokenizer(table, byte_ids):
    tokenizer = table.tokenizer
    rng = np.random.default_rng(1)
    specials = range(len(tokenizer) - 33, len(tokenizer))
    sample = [*rng.integers(0, len(tokenizer), 300).tolist(), *byte_ids.values(), *specials]
    assert [table.texts[i] for i in sample] == [tokenizer.decode([i]) for i in sample]
    assert table.token_bytes[byte_ids[0xE4]] == b"\xe4"
    assert table.token_bytes[tokenizer.convert_tokens_to_ids("<|im_end|>")] == b"<|im_end|>"
    text = "flat 中文 😀 wire"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table.token_bytes[ids]).decode() == text
    assert table.text_lengths[ids].tolist() == [len(tokenizer.decode([i])) for i in ids]
