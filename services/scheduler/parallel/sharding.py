"""How a model's layers split over tensor-parallel ranks, by layer type, as transformers' own plans for the model
name them (its `tp_plan`, and its `ep_plan` for MoE experts), applied to plain tensors:

- a colwise Linear (q, k, v, gate and up projections): each rank keeps a slice of its output features (its
  attention heads, its part of the MLP);
- a rowwise Linear (o and down projections): each rank keeps the matching slice of its input features, and the
  layer's outputs are summed over the ranks (an all-reduce after it); its bias is rank 0's alone;
- MoE experts (fused gate_up [E, 2I, H] and down [E, H, I]): every expert's intermediate features split as an
  MLP's, the experts' output summed over the ranks; the router stays whole, so that every rank routes alike (and
  rank 0 records the routed experts);
- what the plan keeps replicated, and embeddings, norms, routers and the LM head, whole on every rank (the LM head
  runs on rank 0 only: sampling is rank 0's).

Parameters stay plain tensors rather than DTensors: the attention, the KV pool, weight updates and memory release
see the tensors each rank holds, and `local` cuts a rank's part out of a full tensor (a weight update's). A style
the plan names that this engine does not shard refuses the model by name, at start.
"""

import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from services.scheduler.model.architecture import UnsupportedModel

# Styles whose module's output is whole on every rank: keeping the module whole is the same computation. (MLA's
# latent projection, mla_kv_a_proj, is whole too: its style only sums its rope part's gradient.)
REPLICATED = {"replicated_with_grad_allreduce", "replicate", "embedding_rowwise", "embedding_colwise",
              "colwise_gather_output", "colwise_rep", "rowwise_rep", "mla_kv_a_proj"}
# The projections that give each attention head its own columns: each rank must keep its heads' alone, as the KV
# memory keeps its share of the KV heads (model/architecture.py).
HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")
EXPERTS = "ep_dispatch_experts"
EXPERT_TENSORS = "grouped_gemm"  # the experts' parameters in the ep_plan: cut with their module


@dataclass(frozen=True)
class Cut:
    """How one parameter is cut: along `dim`, a 1/size slice per rank; `halves`: a fused gate and up projection,
    each half cut alike; `rank0`: a rowwise layer's bias, added once (rank 0's, zeros elsewhere)."""

    dim: int
    halves: bool = False
    rank0: bool = False

    def local(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        if self.rank0:
            return full if rank == 0 else torch.zeros_like(full)
        if self.halves:
            return torch.cat([_slice(half, self.dim, rank, size) for half in full.chunk(2, dim=self.dim)],
                             dim=self.dim)
        return _slice(full, self.dim, rank, size)

    def divides(self, shape: torch.Size, size: int) -> bool:
        if self.rank0:
            return True
        return shape[self.dim] % (size * (2 if self.halves else 1)) == 0


def _slice(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    width = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * width, width)


@dataclass
class Sharding:
    """One rank's share of the model: the parameters it cuts (by name, as in the model's state_dict), and the
    modules whose outputs it sums over the ranks."""

    rank: int
    size: int
    cuts: dict[str, Cut] = field(default_factory=dict)
    summed: list[str] = field(default_factory=list)  # module names
    full_shapes: dict[str, torch.Size] = field(default_factory=dict)

    @classmethod
    def plan(cls, name: str, model: torch.nn.Module, rank: int, size: int) -> "Sharding":
        """The model's cuts at `size` ranks; UnsupportedModel names what cannot be cut."""
        sharding = cls(rank, size)  # the heads divide: model/architecture.py's layer_specs checked
        tp_plan = dict(getattr(model, "tp_plan", None) or {})
        if not tp_plan:
            raise UnsupportedModel(f"{name}: transformers has no tensor-parallel plan for "
                                   f"{type(model).__name__}: --tp-size {size} cannot shard it")
        plans = [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in tp_plan.items()]
        plans += [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style)
                  for key, style in (getattr(model, "ep_plan", None) or {}).items()]
        def style_of(name: str) -> str | None:
            return next((style for pattern, style in plans if pattern.fullmatch(name)), None)

        for module_name, module in model.named_modules():
            style = style_of(module_name)
            if style is None or style in REPLICATED or style == EXPERT_TENSORS:
                continue
            if style == "colwise" and isinstance(module, torch.nn.Linear):
                sharding._cut(module_name, module, weight=Cut(0), bias=Cut(0))
            elif style == "rowwise" and isinstance(module, torch.nn.Linear):
                sharding._cut(module_name, module, weight=Cut(1), bias=Cut(0, rank0=True))
                sharding.summed.append(module_name)
            elif style == EXPERTS and _fused_experts(module):
                sharding._cut(module_name, module, gate_up_proj=Cut(1, halves=True), down_proj=Cut(2))
                sharding.summed.append(module_name)
            else:
                raise UnsupportedModel(f"{name}: {module_name} ({type(module).__name__}) is sharded as {style!r} in "
                                       "transformers' plan, which this engine does not shard (--tp-size)")
        for parameter, _ in model.named_parameters():  # a parameter of its own in the plan (gpt-oss's sinks)
            style = style_of(parameter)
            if style not in (None, EXPERT_TENSORS, *REPLICATED) and parameter not in sharding.cuts:
                raise UnsupportedModel(f"{name}: {parameter} is sharded as {style!r} in transformers' plan, which "
                                       "this engine does not shard (--tp-size)")
        for module_name, module in model.named_modules():
            for projection in HEAD_PROJECTIONS:
                if isinstance(getattr(module, projection, None), torch.nn.Linear) and \
                        f"{module_name}.{projection}.weight" not in sharding.cuts:
                    raise UnsupportedModel(f"{name}: transformers' plan leaves {module_name}.{projection} whole, and "
                                           "--tp-size cuts every attention layer by its heads")
        for parameter, cut in sharding.cuts.items():
            shape = sharding.full_shapes[parameter]
            if not cut.divides(shape, size):
                raise UnsupportedModel(f"{name}: --tp-size {size} does not divide {parameter} {list(shape)} along "
                                       f"dimension {cut.dim}")
        return sharding

    def _cut(self, module_name: str, module: torch.nn.Module, **cuts: Cut) -> None:
        for parameter, cut in cuts.items():
            tensor = getattr(module, parameter, None)
            if isinstance(tensor, torch.Tensor):
                self.cuts[f"{module_name}.{parameter}"] = cut
                self.full_shapes[f"{module_name}.{parameter}"] = tensor.shape

    def apply(self, model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
        """Keep this rank's part of every cut parameter, and sum the summed modules' outputs over `group`."""
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for name, cut in self.cuts.items():
                parameter = parameters[name]
                parameter.data = cut.local(parameter.data, self.rank, self.size).contiguous()
        modules = dict(model.named_modules())

        def summed(module, inputs, output: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(output, group=group)
            return output

        for name in self.summed:
            modules[name].register_forward_hook(summed)

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter `name`'s full tensor (itself when the parameter is not cut)."""
        cut = self.cuts.get(name)
        return full if cut is None else cut.local(full, self.rank, self.size)

    def full_shape(self, name: str, local: torch.Size) -> torch.Size:
        """The shape of parameter `name` whole, of the shape this rank holds."""
        return self.full_shapes.get(name, local)


def _fused_experts(module: torch.nn.Module) -> bool:
    """transformers' fused experts: gate_up [E, 2I, H] (gate, then up) and down [E, H, I], no biases."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)) or gate_up.dim() != 3:
        return False
    if any(getattr(module, bias, None) is not None for bias in ("gate_up_proj_bias", "down_proj_bias")):
        return False
    return gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
