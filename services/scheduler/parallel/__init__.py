"""Tensor parallelism (--tp-size): the model's layers sharded over ranks, one process each (sharding.py), the
ranks and what rank 0 tells the others (ranks.py), and a rank besides rank 0 (worker.py)."""
