"""The draw of a step's next tokens, on the model's device.

Sampling draws argmax(p / E) with E ~ Exp(1) per vocabulary entry (the exponential
race, equivalent to sampling from p; vLLM's sampler does the same). A seeded request
draws E from its own generator, and every transform below is computed per row, so it
samples the same tokens whatever else is in the batch. The race is also robust to
the last-bit differences that batched kernels introduce, where an inverse-CDF draw
over a flat distribution would flip between neighbouring tokens.
"""

from dataclasses import dataclass

import torch
from flatwire_wire.sampling import SamplingOptions

NUCLEUS_HEAD = 1024  # top-p looks at this many best tokens first


@dataclass
class SamplingBatch:
    """Sampling parameters of the step's non-greedy rows, as host lists: every decision
    below (which rows, which transforms, how many candidates) is made without a device sync."""

    rows: list[int]  # indices of the rows that are not greedy
    temperature: list[float]
    top_p: list[float]  # 1: off
    top_k: list[int]  # below 1: off
    min_p: list[float]  # 0: off
    generators: list[torch.Generator | None]  # per-request streams; None: the default generator

    @classmethod
    def of(cls, sampled: list[tuple[int, SamplingOptions, torch.Generator | None]]) -> "SamplingBatch":
        """The step's rows that are not greedy, each (row, its request's options, its request's random stream)."""
        return cls(rows=[row for row, _, _ in sampled], temperature=[o.temperature for _, o, _ in sampled],
                   top_p=[o.top_p for _, o, _ in sampled], top_k=[o.top_k for _, o, _ in sampled],
                   min_p=[o.min_p for _, o, _ in sampled], generators=[g for _, _, g in sampled])


def put(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


Head = tuple[torch.Tensor, torch.Tensor]  # Draw.head


@dataclass
class Draw:
    """A step's sampled tokens, and the distribution the sampled rows drew them from."""

    tokens: torch.Tensor  # [B] next token per row
    probs: torch.Tensor | None  # [len(params.rows), V] the sampled rows' filtered probabilities, not normalized
    scaled: torch.Tensor | None  # [len(params.rows), V] their logits divided by the temperature, before the cut
    # When every sampled row has a top-p: the ids of each one's NUCLEUS_HEAD most likely tokens after its top-k
    # ([len(params.rows), head], top-p's own), and whether they hold every token it kept ([len(params.rows)] bool)
    head: "Head | None" = None


def sample(logits: torch.Tensor, params: SamplingBatch) -> Draw:
    """Next token per row of float32 logits [B, V]; rows not in params.rows are greedy."""
    if not params.rows:
        return Draw(logits.argmax(dim=-1), None, None)
    temperature = put(params.temperature, torch.float32, logits.device).unsqueeze(1)
    # Every row sampled (a batch of default requests: temperature 1) needs neither a gather nor a greedy argmax
    # over the vocabulary: on a CPU each is a pass as long as the softmax.
    rows = None if params.rows == list(range(logits.shape[0])) else put(params.rows, torch.long, logits.device)
    scaled = (logits if rows is None else logits[rows]) / temperature
    probs = torch.softmax(scaled, dim=-1)
    probs = _keep_top_k(probs, params.top_k)
    probs, head = _keep_top_p(probs, params.top_p)
    if any(min_p > 0 for min_p in params.min_p):
        floor = put(params.min_p, torch.float32, probs.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    race = _exponential_noise(params.generators, probs)
    drawn = torch.div(probs, race, out=race).argmax(dim=-1)
    if rows is None:
        return Draw(drawn, probs, scaled, head)
    tokens = logits.argmax(dim=-1)
    tokens[rows] = drawn
    return Draw(tokens, probs, scaled, head)


def _exponential_noise(generators: list[torch.Generator | None], like: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws shaped like `like` [S, V]; row i from generators[i]."""
    uniforms = torch.empty_like(like)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        uniforms.uniform_()
    elif shared:
        uniforms[shared] = torch.rand(len(shared), like.shape[1], device=like.device, dtype=like.dtype)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row].uniform_(generator=generator)
    return uniforms.log_().neg_()  # -log(0) = inf only zeroes that entry's score


def _threshold(rows: list[int], values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[S, 1] per-row floor: `values` on `rows`, 0 (keep everything) elsewhere."""
    threshold = torch.zeros(like.shape[0], 1, dtype=like.dtype, device=like.device)
    threshold[rows] = values
    return threshold


def _keep_top_k(probs: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    rows = [i for i, k in enumerate(top_k) if k > 0]
    if not rows:
        return probs
    k = [min(top_k[i], probs.shape[-1]) for i in rows]
    kth = probs[rows].topk(max(k), dim=-1).values.gather(1, put(k, torch.long, probs.device).unsqueeze(1) - 1)
    return probs.masked_fill(probs < _threshold(rows, kth, probs), 0.0)


def _keep_top_p(probs: torch.Tensor, top_p: list[float]) -> tuple[torch.Tensor, Head | None]:
    """The probabilities cut by each row's top-p, and (Draw.head) the ids of the head it looked at, when it looked
    at a head and every row has a top-p."""
    rows = [i for i, p in enumerate(top_p) if p < 1]
    if not rows:
        return probs, None
    candidates = probs[rows]
    limit = put([top_p[i] for i in rows], torch.float32, probs.device).unsqueeze(1) * candidates.sum(-1, keepdim=True)
    # A real model's nucleus is usually small: sort only the head when it holds enough mass.
    ordered, ids = candidates.topk(min(NUCLEUS_HEAD, candidates.shape[-1]), dim=-1)
    head_held = bool((ordered.sum(dim=-1, keepdim=True) >= limit).all())
    if not head_held:
        ordered = candidates.sort(dim=-1, descending=True).values
    mass_before = ordered.cumsum(dim=-1) - ordered
    kept = (mass_before < limit).sum(dim=-1, keepdim=True).clamp_min(1)
    threshold = ordered.gather(1, kept - 1)
    cut = probs.masked_fill(probs < _threshold(rows, threshold, probs), 0.0)
    if not head_held or len(rows) < len(top_p):
        return cut, None
    # Every token the cut kept is in the head, unless one past it ties the threshold (or the head is everything).
    return cut, (ids, (ordered[:, -1] < threshold[:, 0]) | (ids.shape[1] == probs.shape[1]))


def nuclei(draw: Draw, params: SamplingBatch, rows: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p replay: the nucleus each of the step's `rows` drew its token from, as (sizes [len(rows)] int32, ids
    [sum(sizes)] int32, row after row, ascending): a sampled row's, the tokens its cut left a probability (what
    top-k, top-p and min-p kept, less any whose probability underflowed to 0: it could not be drawn); a greedy
    row's, its token alone. Read from top-p's head when it holds them all (a peaked distribution's: a few
    thousand entries), else in a pass over the rows' probabilities. On CUDA, sizing the ids waits for the device."""
    sampled_at = {row: i for i, row in enumerate(params.rows)}
    device = draw.tokens.device
    if all(row in sampled_at for row in rows):
        assert draw.probs is not None  # params.rows were sampled
        of_draw = put([sampled_at[row] for row in rows], torch.long, device)
        if draw.head is not None and bool(draw.head[1][of_draw].all()):
            ids = draw.head[0][of_draw].sort(dim=-1).values
            kept = draw.probs[of_draw.unsqueeze(1), ids] > 0  # the head's entries only
            return kept.sum(dim=1, dtype=torch.int32), ids[kept].to(torch.int32)
        every = len(rows) == len(params.rows) and all(sampled_at[row] == j for j, row in enumerate(rows))
        kept = (draw.probs if every else draw.probs[of_draw]) > 0
    else:
        kept = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
        greedy = [j for j, row in enumerate(rows) if row not in sampled_at]
        kept[put(greedy, torch.long, device), draw.tokens[put([rows[j] for j in greedy], torch.long, device)]] = True
        if sampled := [j for j, row in enumerate(rows) if row in sampled_at]:
            assert draw.probs is not None
            kept[put(sampled, torch.long, device)] = \
                draw.probs[put([sampled_at[rows[j]] for j in sampled], torch.long, device)] > 0
    return kept.sum(dim=1, dtype=torch.int32), kept.nonzero()[:, 1].to(torch.int32)
