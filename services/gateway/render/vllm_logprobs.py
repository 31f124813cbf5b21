"""vLLM's logprob shapes.

`prompt_logprobs` (chat's top-level field, each completions choice's, /inference/v1/generate's): one entry per
prompt position,
null for the first (nothing precedes it), then {"<token id>": {"logprob", "rank", "decoded_token"}}: the prompt
token's own entry first, then the top-k (ranks 1..k), each id once, as vLLM's dict of Logprob is written.

- rank: the top-k's are 1..k, and the prompt token's is its place among them; for a prompt token outside its
  position's top-k it is null (vLLM counts the vocabulary above it: flatwire's rows carry no such count).
- logprob: -inf is written -9999.0, as vLLM clamps it (JSON has no -inf).
- decoded_token: the token's own text (its id decoded alone, special tokens kept), as vLLM's.

/inference/v1/generate's output `logprobs` (vLLM's GenerateLogProbs): {"content": [...]}, per output token
{"token_id", "logprob", "rank", "top_logprobs"}, top_logprobs the first max(k, 1) entries of vLLM's dict of the
position: the sampled token first, then the top-k in rank order, each id once. Ranks and clamping as above (vLLM
writes null for a rank it does not know).
"""

import dataclasses

import numpy as np
import orjson
from flatwire_wire.logprobs import F32, I32, RequestLogprobs

from services.gateway.render.pieces import token_texts, value_texts
from services.gateway.token_table import TokenTable

CLAMPED = np.float32(-9999.0)  # vLLM's stand-in for -inf


def prompt_logprobs(track: RequestLogprobs, k: int, table: TokenTable) -> orjson.Fragment:
    """The prompt's rows as vLLM's list; `k`: the top-k asked for (the rows may hold more, for the output's)."""
    ids = np.concatenate([track.token_ids[:, None], track.topk_ids[:, :k]], axis=1).astype(I32, copy=False)
    values = np.concatenate([track.token_logprobs[:, None], track.topk_values[:, :k]], axis=1).astype(F32)
    values[np.isneginf(values)] = CLAMPED
    in_top = ids[:, 1:] == ids[:, :1]  # the prompt token among its top-k
    ranks = np.empty(ids.shape, dtype=object)
    ranks[:, 1:] = value_texts(np.broadcast_to(np.arange(1, k + 1, dtype=I32), (len(ids), k)), I32)
    token_rank = (in_top.argmax(axis=1) if k else np.zeros(len(ids), np.int64)) + 1
    ranks[:, 0] = np.where(in_top.any(axis=1), value_texts(token_rank.astype(I32), I32), b"null")
    entries = (b'"' + value_texts(ids, I32) + b'":{"logprob":' + value_texts(values) + b',"rank":' + ranks
               + b',"decoded_token":' + token_texts(table)[ids] + b"}")
    keep = np.concatenate([np.ones((len(ids), 1), dtype=bool), ~in_top], axis=1)  # each id once
    rows = [b"{" + b",".join(row[mask]) + b"}" for row, mask in zip(entries, keep)]
    return orjson.Fragment(b"[" + b",".join([b"null"] * track.null_prefix + rows) + b"]")


def top_k(track: RequestLogprobs, k: int) -> RequestLogprobs:
    """The track with its first `k` candidates per row (views): its side's top-k, where the rows hold the other
    side's larger one (the scheduler computes one top-k for the prompt and the output)."""
    if track.k == k:
        return track
    return dataclasses.replace(track, topk_values=track.topk_values[:, :k], topk_ids=track.topk_ids[:, :k])


def generate_logprobs(track: RequestLogprobs, k: int) -> orjson.Fragment:
    """One choice's output rows as vLLM's token-in/token-out route writes them; `k`: the top-k asked for."""
    ids = np.concatenate([track.token_ids[:, None], track.topk_ids[:, :k]], axis=1).astype(I32, copy=False)
    values = np.concatenate([track.token_logprobs[:, None], track.topk_values[:, :k]], axis=1).astype(F32)
    values = np.where(np.isnan(values), CLAMPED, np.maximum(values, CLAMPED))
    in_top = ids[:, 1:] == ids[:, :1]  # the sampled token among its top-k: its value and rank from there
    found, slot = in_top.any(axis=1), in_top.argmax(axis=1) if k else np.zeros(len(ids), np.int64)
    ranks = np.empty(ids.shape, dtype=object)
    ranks[:, 1:] = value_texts(np.broadcast_to(np.arange(1, k + 1, dtype=I32), (len(ids), k)), I32)
    ranks[:, 0] = np.where(found, value_texts((slot + 1).astype(I32), I32), b"null")
    entries = (b'{"token_id":' + value_texts(ids, I32) + b',"logprob":' + value_texts(values) + b',"rank":' + ranks
               + b"}")
    keep = np.concatenate([np.ones((len(ids), 1), dtype=bool), ~in_top], axis=1)  # each id once
    limit = max(k, 1)
    rows = [entry[0][:-1] + b',"top_logprobs":[' + b",".join(entry[mask][:limit]) + b"]}"
            for entry, mask in zip(entries, keep)]
    return orjson.Fragment(b'{"content":[' + b",".join(rows) + b"]}")
