"""The computations of a Gated DeltaNet layer (Qwen3.5, Qwen3-Next) over a step's rows, one implementation per
--linear-attention-backend; model/linear_attention.py owns the layer and its state slots and calls these.

Each takes the states of the rows it computes (gathered from their slots: conv [N, conv_dim, kernel - 1],
recurrent [N, Hv, dk, dv]) and returns their new ones, which the caller puts back:

- torch: transformers' torch rules (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule) and the
  causal convolution as transformers computes it without its kernel; one sequence at a time. CPU, and the reference
  (on CUDA with flash-linear-attention installed, transformers' rules call fla's kernels themselves).
- fla: the flash-linear-attention Triton kernels (the `flash-linear-attention` package): chunk_gated_delta_rule over
  every prefill sequence of the step at once (cu_seqlens), fused_recurrent_gated_delta_rule for the decoding rows,
  and fla's own Triton causal conv1d (causal_conv1d over cu_seqlens, causal_conv1d_update), so no CUDA-only
  package is needed. Imported only when asked for; runs on CUDA, or on the CPU in Triton's interpreter
  (TRITON_INTERPRET=1: the tests). fla keeps a conv state of the whole kernel width, one column more than a slot:
  the column before the slot's is never read (it falls out of the window), so it is padded with zeros.
"""

from typing import Protocol

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from services.scheduler.model.attention import BackendUnavailable, require_triton

BACKENDS = ("torch", "fla")
FUSED_ACTIVATIONS = ("silu", "swish")  # what fla's conv applies itself


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    return ACT2FN[activation](x) if activation else x


class GatedDeltaKernels(Protocol):
    def conv_chunks(self, x: torch.Tensor, states: torch.Tensor, bounds: list[int], weight: torch.Tensor,
                    bias: torch.Tensor | None, activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence n's inputs x[bounds[n]:bounds[n + 1]] of x [T, conv_dim], after its last inputs states[n],
        through the causal convolution `weight` [conv_dim, kernel] -> (outputs [T, conv_dim], new states)."""

    def conv_step(self, x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One input x[n] [N, conv_dim] of each of N sequences -> (outputs [N, conv_dim], new states)."""

    def chunked_rule(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, states: torch.Tensor,
                     bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over sequences laid end to end (query, key [1, T, Hk, dk], value [1, T, Hv, dv], g,
        beta [1, T, Hv]), sequence n from states[n] -> (outputs [1, T, Hv, dv], final states [N, Hv, dk, dv])."""

    def recurrent_rule(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of N sequences (query, key [N, 1, Hk, dk], value [N, 1, Hv, dv], g, beta [N, 1, Hv])
        -> (outputs [N, 1, Hv, dv], new states)."""


class TorchKernels:
    def conv_chunks(self, x, states, bounds, weight, bias, activation):
        outputs, finals = [], []
        for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
            window = torch.cat([states[n], x[start:end].T.to(states.dtype)], dim=-1)
            finals.append(window[:, -states.shape[-1]:])
            convolved = F.conv1d(window[None].to(weight.dtype), weight.unsqueeze(1), bias, groups=window.shape[0])
            outputs.append(_activate(convolved[0].T, activation))
        return torch.cat(outputs), torch.stack(finals)

    def conv_step(self, x, states, weight, bias, activation):
        window = torch.cat([states, x.unsqueeze(-1).to(states.dtype)], dim=-1)
        convolved = (window.to(weight.dtype) * weight[None]).sum(-1)  # transformers' causal_conv1d_update, 1 token
        if bias is not None:
            convolved = convolved + bias
        return _activate(convolved, activation), window[:, :, 1:]

    def chunked_rule(self, query, key, value, g, beta, states, bounds):
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        outputs, finals = [], []
        for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
            span = slice(start, end)
            attended, final = torch_chunk_gated_delta_rule(
                query[:, span], key[:, span], value[:, span], g=g[:, span], beta=beta[:, span],
                initial_state=states[n:n + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
            outputs.append(attended)
            finals.append(final)
        return torch.cat(outputs, dim=1), torch.cat(finals)

    def recurrent_rule(self, query, key, value, g, beta, states):
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

        return torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=states,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)


class FlaKernels:
    def __init__(self):
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        self._conv, self._conv_update = causal_conv1d, causal_conv1d_update
        self._chunk, self._recurrent = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    @staticmethod
    def _widened(states: torch.Tensor) -> torch.Tensor:
        """A slot's conv state [N, D, kernel - 1] as fla keeps it [N, D, kernel]: a column of zeros before."""
        return F.pad(states, (1, 0)).contiguous()

    @staticmethod
    def _bounds(bounds: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cu_seqlens on the device and on the host (fla reads the host copy to plan its chunks: no sync)."""
        host = torch.tensor(bounds, dtype=torch.long)
        return host.to(device, non_blocking=True), host

    def conv_chunks(self, x, states, bounds, weight, bias, activation):
        fused = activation if activation in FUSED_ACTIVATIONS else None
        device_bounds, host_bounds = self._bounds(bounds, x.device)
        convolved, finals = self._conv(x[None].to(weight.dtype), weight, bias,
                                       initial_state=self._widened(states.to(weight.dtype)), output_final_state=True,
                                       activation=fused, cu_seqlens=device_bounds, cu_seqlens_cpu=host_bounds)
        outputs = convolved[0] if fused else _activate(convolved[0], activation)
        return outputs, finals[:, :, 1:]

    def conv_step(self, x, states, weight, bias, activation):
        fused = activation if activation in FUSED_ACTIVATIONS else None
        window = self._widened(states.to(weight.dtype))
        convolved, window = self._conv_update(x.to(weight.dtype).contiguous(), window, weight=weight, bias=bias,
                                              activation=fused)  # updates `window` in place
        return (convolved if fused else _activate(convolved, activation)), window[:, :, 1:]

    def chunked_rule(self, query, key, value, g, beta, states, bounds):
        device_bounds, host_bounds = self._bounds(bounds, query.device)
        return self._chunk(query, key, value, g=g, beta=beta, initial_state=states, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, cu_seqlens=device_bounds, cu_seqlens_cpu=host_bounds)

    def recurrent_rule(self, query, key, value, g, beta, states):
        return self._recurrent(query, key, value, g=g, beta=beta, initial_state=states, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)


def gated_delta_kernels(backend: str, device: torch.device) -> GatedDeltaKernels:
    """--linear-attention-backend's kernels, if they can run on `device`."""
    if backend not in BACKENDS:
        raise BackendUnavailable(f"--linear-attention-backend: expected one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "torch":
        return TorchKernels()
    require_triton("--linear-attention-backend fla", device)
    try:
        return FlaKernels()
    except ImportError as exc:
        raise BackendUnavailable(f"--linear-attention-backend fla: the flash-linear-attention package is not "
                                 f"installed ({exc}); pip install flash-linear-attention") from None
