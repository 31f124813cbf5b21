"""The step's single device-to-host copy.

Everything a step returns is packed into one float32 buffer (integer tensors as int32 bit patterns), copied
once, and split back into numpy views on the host, in the same shapes: the sampled ids and the logprob rows.
"""

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    flat = [t.reshape(-1).to(torch.float32) if t.is_floating_point()
            else t.reshape(-1).to(torch.int32).view(torch.float32)
            for t in tensors]
    host = torch.cat(flat).cpu().numpy() if flat else np.empty(0, np.float32)
    arrays, offset = [], 0
    for tensor, piece in zip(tensors, flat):
        view = host[offset:offset + piece.numel()]
        arrays.append((view if tensor.is_floating_point() else view.view(np.int32)).reshape(tensor.shape))
        offset += piece.numel()
    return arrays


def copy_to_host(next_ids: torch.Tensor, output: LogprobRows[torch.Tensor] | None,
                 prompt: list[LogprobRows[torch.Tensor]]
                 ) -> tuple[np.ndarray, LogprobRows[np.ndarray] | None, list[LogprobRows[np.ndarray]]]:
    """The step's sampled ids, output rows and prompt rows, on the host."""
    row_sets = ([output] if output is not None else []) + prompt
    host = iter(_to_host([next_ids, *(array for rows in row_sets for array in rows.arrays)]))
    host_ids = next(host)
    host_rows = [LogprobRows(next(host), next(host), next(host), next(host)) for _ in row_sets]
    if output is None:
        return host_ids, None, host_rows
    return host_ids, host_rows[0], host_rows[1:]
