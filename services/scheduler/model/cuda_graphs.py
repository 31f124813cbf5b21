"""Decode steps replayed from CUDA graphs (--enable-cuda-graph), one captured per batch size of a ladder.

A decode step of a small batch spends most of its time launching kernels from Python (a transformers forward:
several kernels per layer). A graph captured once per batch size replays them all in one launch. A step whose
rows all decode, at most --cuda-graph-max-bs of them, runs the graph of the smallest captured size that holds
it: its inputs (token ids, positions, KV write slots, page tables) are copied into the graph's static buffers,
the rows past the batch padded with position 0 of page 0 (the padding page, which no request reads), and the
forward replayed. Prefill and mixed steps, and larger batches, run eagerly.

Attention in a graph is the Triton kernel (model/triton_attention.py), whose launch shapes depend on the batch
size alone; the torch path's shapes depend on the rows' lengths. Graphs hold the addresses of the weights and
the KV memory: when either is replaced (a weight update swaps tensors in, a memory release and resume
reallocates them) the engine calls `forget`, and each size is captured again when next used.

Without CUDA (the tests), `DecodeGraphs(capture=False)` runs the same static-buffer forward eagerly: the padding
and the bookkeeping are the graphs', only the replay is not.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.scheduler.kv.pool import KVPool
from services.scheduler.model.attention import GroupStep, PagedBatch
from services.scheduler.model.triton_attention import DECODE_BLOCK_N, Launch, TritonPlan, block_m_for, decode_splits

DecoderForward = Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]  # ids, positions -> hidden [T, h]


def capture_sizes(max_batch: int) -> list[int]:
    """SGLang's kind of ladder: 1, 2, 4, 8, then every 8 to 256 and every 16 past it, up to `max_batch`."""
    ladder = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_batch + 1, 16))
    sizes = [size for size in ladder if size < max_batch]
    return sizes + [max_batch]


def padded_size(sizes: list[int], batch: int) -> int | None:
    """The smallest captured size that holds `batch` rows; None past the largest."""
    return next((size for size in sizes if size >= batch), None)


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph | None"
    run: Callable[[], None]  # the captured forward, eagerly (without CUDA)


class DecodeGraphs:
    def __init__(self, forward: DecoderForward, kv: KVPool, hidden_size: int, dtype: torch.dtype, group: int,
                 max_pages: int, max_batch: int, device: torch.device, capture: bool = True):
        """`forward`: the decoder over flat ids and positions [T] with a PagedBatch -> hidden states [T, hidden];
        `max_pages`: of one request's page table (its longest context)."""
        self.forward, self.kv, self.group, self.device, self.capture = forward, kv, group, device, capture
        self.sizes = capture_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.write_pages = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.write_offsets = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.key_positions = torch.zeros(max_batch, dtype=torch.int32, device=device)  # the kernel's, int32
        self.page_tables = torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self._rows = torch.arange(max_batch, dtype=torch.int32, device=device)
        self._ones = torch.ones(max_batch, dtype=torch.int32, device=device)
        self._captured: dict[int, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps run from a captured size (for tests and logs)

    def holds(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def forget(self) -> None:
        """The weights or the KV memory were reallocated: what was captured reads the old addresses."""
        self._captured.clear()

    def run(self, input_ids: np.ndarray, positions: np.ndarray, tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [B, hidden] of B decoding rows: row i's token input_ids[i] at positions[i], its KV in
        tables[i]."""
        batch = len(input_ids)
        size = padded_size(self.sizes, batch)
        assert size is not None, f"{batch} rows: more than the largest captured size {self.sizes[-1]}"
        page_size = self.kv.page_size
        needed = positions // page_size + 1  # pages each row's context reaches
        width = int(needed.max())
        staged = np.zeros((4, size), dtype=np.int64)  # ids, positions, write pages, write offsets; padding: zeros
        staged[0, :batch], staged[1, :batch] = input_ids, positions
        table_block = np.zeros((size, width), dtype=np.int32)
        for i, (table, count) in enumerate(zip(tables, needed.tolist())):
            table_block[i, :count] = table[:count]
        staged[2, :batch] = table_block[np.arange(batch), needed - 1]
        staged[3, :batch] = positions % page_size
        host = torch.from_numpy(staged).to(self.device, non_blocking=True)
        for buffer, values in zip((self.input_ids, self.positions, self.write_pages, self.write_offsets), host):
            buffer[:size].copy_(values)
        self.key_positions[:size].copy_(host[1])
        # Columns past `width` keep older steps' pages: no row of this step reads that far.
        self.page_tables[:size, :width].copy_(torch.from_numpy(table_block).to(self.device, non_blocking=True))
        captured = self._captured.get(size) or self._capture(size)
        if captured.graph is not None:
            captured.graph.replay()
        else:
            captured.run()
        self.replays += 1
        return self.hidden[:batch]

    def _capture(self, size: int) -> _Captured:
        splits = decode_splits(size, self.kv.groups[0].spec.page_shape[0], self.device)
        launch = Launch(self._rows[:size], self._rows[:size], self._ones[:size], self.key_positions[:size],
                        block_m_for(self.group, 1), DECODE_BLOCK_N, splits)
        plan = TritonPlan(self.page_tables[:size], [launch], self.group)
        paged = PagedBatch(self.kv, self.write_offsets[:size], [GroupStep(self.write_pages[:size], plan)])

        def run() -> None:
            self.hidden[:size].copy_(self.forward(self.input_ids[:size], self.positions[:size], paged))

        graph = None
        if self.capture:
            run()  # a warm-up outside the graph: Triton compiles and torch allocates its workspaces here
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                run()
        self._captured[size] = _Captured(graph, run)
        return self._captured[size]
