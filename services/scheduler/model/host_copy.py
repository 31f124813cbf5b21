"""The step's single device-to-host copy.

Everything a step returns is packed into one float32 buffer (integer tensors as int32 bit patterns), copied
once, and split back into numpy views on the host, in the same shapes: the sampled ids, the logprob rows and the
top-p replay nuclei.
On CUDA the copy goes into pinned memory without waiting for it (`HostRows.wait` does), so that with the
overlap schedule the host builds the previous step's output while the device computes this one.
"""

from dataclasses import dataclass

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows
from flatwire_wire.nucleus import Nuclei


@dataclass
class HostRows:
    """A step's ids and logprob rows on their way to the host."""

    host: torch.Tensor  # the packed buffer, once `done`
    done: "torch.cuda.Event | None"  # None: copied already
    shapes: list[tuple[torch.Size, bool]]  # each tensor's shape, and whether it is floating point
    has_output: bool  # the second tensor set is the output rows (else only prompt rows follow the ids)
    has_nuclei: bool  # the last two tensors are the nuclei's sizes and ids

    def wait(self) -> tuple[np.ndarray, LogprobRows[np.ndarray] | None, list[LogprobRows[np.ndarray]],
                            Nuclei | None]:
        """The step's sampled ids, output rows, prompt rows and nuclei, on the host."""
        if self.done is not None:
            self.done.synchronize()
        flat = self.host.numpy()
        arrays, offset = [], 0
        for shape, floating in self.shapes:
            view = flat[offset:offset + shape.numel()]
            arrays.append((view if floating else view.view(np.int32)).reshape(shape))
            offset += shape.numel()
        nuclei = Nuclei.of_sizes(*arrays[-2:]) if self.has_nuclei else None
        if self.has_nuclei:
            arrays = arrays[:-2]
        host = iter(arrays)
        host_ids = next(host)
        rows = [LogprobRows(next(host), next(host), next(host), next(host)) for _ in range((len(arrays) - 1) // 4)]
        if not self.has_output:
            return host_ids, None, rows, nuclei
        return host_ids, rows[0], rows[1:], nuclei


def copy_to_host(next_ids: torch.Tensor, output: LogprobRows[torch.Tensor] | None,
                 prompt: list[LogprobRows[torch.Tensor]],
                 nuclei: tuple[torch.Tensor, torch.Tensor] | None = None) -> HostRows:
    """Start copying the step's sampled ids, output rows, prompt rows and nuclei (sizes, ids) to the host."""
    row_sets = ([output] if output is not None else []) + prompt
    tensors = [next_ids, *(array for rows in row_sets for array in rows.arrays), *(nuclei or ())]
    flat = [t.reshape(-1).to(torch.float32) if t.is_floating_point()
            else t.reshape(-1).to(torch.int32).view(torch.float32)
            for t in tensors]
    shapes = [(t.shape, t.is_floating_point()) for t in tensors]
    packed = torch.cat(flat)
    if packed.device.type != "cuda":
        return HostRows(packed.cpu(), None, shapes, output is not None, nuclei is not None)
    host = torch.empty(packed.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostRows(host, done, shapes, output is not None, nuclei is not None)
