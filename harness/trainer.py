"""An RL trainer's side of a weight sync, as the frameworks write it (slime, OpenRLHF and verl carry this helper):
rank 0 of a torch.distributed group it makes with torch's own rendezvous, broadcasting a checkpoint's tensors to
the inference servers. It imports nothing of flatwire's, so that the servers' side is checked against a trainer's.

    python -m harness.trainer --port P --world-size 3 --checkpoint DIR [--bucket] [--dtype bfloat16]
                              [--die-after N]

It prints one JSON line, the tensors it will send ({"names", "dtypes", "shapes"}: the request body), then joins,
then broadcasts them in that order (or, with --bucket, their flattened concatenation, one broadcast); with
--die-after N it exits abruptly after N tensors, as a trainer that crashes mid-sync.
"""

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


def init_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                       timeout: timedelta) -> dist.ProcessGroup:
    """The frameworks' init_process_group: a process group besides the default one, its store prefixed."""
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--group-name", default="weight_update_group")
    parser.add_argument("--dtype", default=None, help="cast every tensor to this dtype first")
    parser.add_argument("--bucket", action="store_true", help="one flattened broadcast of every tensor")
    parser.add_argument("--die-after", type=int, default=None)
    args = parser.parse_args()

    tensors = {}
    for file in sorted(args.checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    if args.dtype:
        tensors = {name: tensor.to(getattr(torch, args.dtype)) for name, tensor in tensors.items()}
    names = sorted(tensors)
    print(json.dumps({"names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
                      "shapes": [list(tensors[n].shape) for n in names]}), flush=True)
    group = init_process_group("gloo", f"tcp://127.0.0.1:{args.port}", args.world_size, 0, args.group_name,
                               timedelta(seconds=120))
    if args.bucket:
        dist.broadcast(torch.cat([tensors[n].flatten() for n in names]), src=0, group=group)
    else:
        for sent, name in enumerate(names):
            if sent == args.die_after:
                sys.stdout.flush()
                os._exit(1)
            dist.broadcast(tensors[name], src=0, group=group)
    dist.destroy_process_group(group)


if __name__ == "__main__":
    main()
