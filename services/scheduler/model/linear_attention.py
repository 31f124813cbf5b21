"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) over the step's flat batch, each request's state in its
slot of the KV pool (kv/pool.py: a conv state and a recurrent state per linear layer and slot).

transformers' layer runs one sequence, its state in a Cache. Here every row of the step is a request of its own:
its causal convolution starts from the last inputs its slot keeps, and the gated delta rule from its recurrent
state. Decoding rows (one token each) are one batched recurrent update, as transformers' cached decode runs; the
prefill chunks run the chunked rule, each over its own tokens (no padding to the longest). A row that starts anew
starts from zeros, or from a checkpoint of the prefix cache (a copy into its slot); a row that reaches a page
boundary leaves a copy of the state there in a checkpoint slot (the chunk split at the boundary), for the prefix
cache to keep (kv/states.py). What computes them is --linear-attention-backend's (model/gated_delta_kernels.py:
transformers' torch rules, or the flash-linear-attention kernels); transformers' own forward is the reference every
path is tested against.

`use_paged_state(model, kernels)` swaps this forward in for every Gated DeltaNet layer; the step's PagedBatch
reaches it as a forward kwarg, as it reaches model/attention.py.
"""

import functools
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.kv.manager import FRESH
from services.scheduler.model.gated_delta_kernels import GatedDeltaKernels


@dataclass
class StateRows:
    """What a step's rows need of the state slots (built once per step, used by every linear layer)."""

    slots: list[int]  # each row's state slot (its request slot)
    firsts: list[int]  # each row's first index in the flat sequence
    counts: list[int]  # its tokens
    restore: list[int | None]  # where its state starts from: FRESH, a checkpoint slot, or None (its slot's)
    captures: list[tuple[int, int] | None]  # (tokens into the row, checkpoint slot): the state there is kept

    @functools.cached_property
    def decoding(self) -> list[int]:
        """Rows of one token that continue their state: one batched recurrent update."""
        return [i for i, count in enumerate(self.counts) if count == 1 and self.restore[i] is None]

    @functools.cached_property
    def prefill_waves(self) -> list[list[tuple[int, int, int]]]:
        """The other rows as spans (row, first, end in the flat sequence), in at most two waves, each one kernel
        call per layer: a row whose checkpoint falls inside it runs up to it in the first wave (its state is kept
        there) and on from it in the second."""
        first: list[tuple[int, int, int]] = []
        second: list[tuple[int, int, int]] = []
        for i in sorted(set(range(len(self.slots))) - set(self.decoding)):
            start, count, capture = self.firsts[i], self.counts[i], self.captures[i]
            cut = capture[0] if capture is not None and capture[0] < count else count
            first.append((i, start, start + cut))
            if cut < count:
                second.append((i, start + cut, start + count))
        return [wave for wave in (first, second) if wave]


def is_gated_delta_net(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_v_dim"))


def use_paged_state(model: nn.Module, kernels: GatedDeltaKernels) -> int:
    """Route every Gated DeltaNet layer through the paged state, computed by `kernels`; how many layers that is."""
    layers = [module for module in model.modules() if is_gated_delta_net(module)]
    for module in layers:
        module.forward = types.MethodType(functools.partial(gated_delta_net, kernels=kernels), module)
    return len(layers)


def _projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed q, k, v [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv]) of flat hidden states [T, hidden]: Qwen3.5's
    separate projections, or Qwen3-Next's fused ones in their grouped order."""
    if hasattr(self, "in_proj_qkvz"):
        query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden[None]),
                                                                       self.in_proj_ba(hidden[None]))
        mixed = torch.cat([x.reshape(x.shape[1], -1) for x in (query, key, value)], dim=-1)
        return mixed, z[0], b[0], a[0]
    tokens = hidden.shape[0]
    return (self.in_proj_qkv(hidden), self.in_proj_z(hidden).view(tokens, -1, self.head_v_dim),
            self.in_proj_b(hidden), self.in_proj_a(hidden))


def gated_delta_net(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, paged_batch=None,
                    kernels: GatedDeltaKernels | None = None, **kwargs):
    """Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet.forward over the step's flat batch [1, T, hidden]."""
    assert paged_batch is not None and paged_batch.states is not None and kernels is not None  # use_paged_state's
    rows: StateRows = paged_batch.states
    conv_states, recurrent_states = paged_batch.pool.states(self.layer_idx)
    _restore(rows, conv_states, recurrent_states)
    mixed, z, b, a = _projections(self, hidden_states[0])
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # float: in half precision A may be -inf
    weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias  # [conv_dim, kernel]
    out = mixed.new_empty(mixed.shape[0], z.shape[1], self.head_v_dim)
    device = mixed.device

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [tokens, conv_dim] -> query, key [1, tokens, Hk, dk], value [1, tokens, Hv, dv]."""
        query, key, value = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        tokens = x.shape[0]
        return (query.reshape(1, tokens, -1, self.head_k_dim), key.reshape(1, tokens, -1, self.head_k_dim),
                value.reshape(1, tokens, -1, self.head_v_dim))

    if decoding := rows.decoding:
        slots = torch.tensor([rows.slots[i] for i in decoding], device=device)
        flat = torch.tensor([rows.firsts[i] for i in decoding], device=device)
        convolved, conv_states[slots] = kernels.conv_step(mixed[flat], conv_states[slots], weight, bias,
                                                          self.activation)
        # one token of each row, as a batch of one token each
        query, key, value = (x.transpose(0, 1) for x in split(convolved))
        attended, state = kernels.recurrent_rule(query, key, value, g[flat].unsqueeze(1), beta[flat].unsqueeze(1),
                                                 recurrent_states[slots])
        recurrent_states[slots] = state.to(recurrent_states.dtype)
        out[flat] = attended[:, 0].to(out.dtype)
    for wave in rows.prefill_waves:
        slots = torch.tensor([rows.slots[i] for i, _, _ in wave], device=device)
        flat = torch.cat([torch.arange(start, end) for _, start, end in wave]).to(device)
        bounds = np.cumsum([0] + [end - start for _, start, end in wave]).tolist()
        convolved, conv_states[slots] = kernels.conv_chunks(mixed[flat], conv_states[slots], bounds, weight, bias,
                                                            self.activation)
        query, key, value = split(convolved)
        attended, state = kernels.chunked_rule(query, key, value, g[flat][None], beta[flat][None],
                                               recurrent_states[slots], bounds)
        recurrent_states[slots] = state.to(recurrent_states.dtype)
        out[flat] = attended[0].to(out.dtype)
        for i, _, end in wave:
            if (capture := rows.captures[i]) is not None and end == rows.firsts[i] + capture[0]:
                _keep(conv_states, recurrent_states, rows.slots[i], capture[1])
    for i in decoding:
        if (capture := rows.captures[i]) is not None:  # a decoding row whose token ends a page
            _keep(conv_states, recurrent_states, rows.slots[i], capture[1])
    normed = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(normed.reshape(1, out.shape[0], -1))


def _restore(rows: StateRows, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    """Each row that starts anew takes its state: zeros, or a copy of a checkpoint."""
    for slot, source in zip(rows.slots, rows.restore):
        if source == FRESH:
            conv[slot].zero_()
            recurrent[slot].zero_()
        elif source is not None:
            conv[slot] = conv[source]
            recurrent[slot] = recurrent[source]


def _keep(conv: torch.Tensor, recurrent: torch.Tensor, slot: int, checkpoint: int) -> None:
    conv[checkpoint] = conv[slot]
    recurrent[checkpoint] = recurrent[slot]


def state_rows(slots: list[int], starts: np.ndarray, counts: np.ndarray, restore: list[int | None],
               captures: list[tuple[int, int] | None], page_size: int) -> StateRows:
    """The rows' StateRows: `captures` per row (pages, checkpoint slot) after that many pages of the sequence."""
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
    at = [None if capture is None else (capture[0] * page_size - int(start), capture[1])
          for capture, start in zip(captures, starts.tolist())]
    return StateRows(slots, firsts, counts.tolist(), restore, at)
