"""The step's single device-to-host copy.

Everything a step returns is packed into one float32 buffer (integer tensors as
int32 bit patterns), copied once, and split back into numpy views on the host.
"""

import numpy as np
import torch


def copy_to_host(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    flat = [t.reshape(-1).to(torch.float32) if t.is_floating_point()
            else t.reshape(-1).to(torch.int32).view(torch.float32)
            for t in tensors.values()]
    host = torch.cat(flat).cpu().numpy() if flat else np.empty(0, np.float32)
    arrays, offset = {}, 0
    for (name, tensor), piece in zip(tensors.items(), flat):
        view = host[offset:offset + piece.numel()]
        arrays[name] = (view if tensor.is_floating_point() else view.view(np.int32)).reshape(tensor.shape)
        offset += piece.numel()
    return arrays
