"""Giving the model's memory back to a trainer colocated with the engine, and taking it again: SGLang's
release_memory_occupation / resume_memory_occupation (vLLM's sleep / wake_up), with its tags `weights`,
`kv_cache`, `cuda_graph` and `weights_drafter`.

Released KV memory is freed (its pages held nothing: release needs an idle engine) and reallocated on resume.
Released weights are copied to the host when the model is on CUDA and copied back on resume. On CPU there is
no lower tier: they are dropped, and resume reads them again from the checkpoint they came from; weights that
came from a push or a broadcast are not on disk, so resume leaves zeros and the engine refuses requests until
an update brings every tensor (RL trainers resume, then update, as SGLang expects). Released decode graphs
(`cuda_graph`, with --enable-cuda-graph) are dropped, their memory with them, and captured again when next used
once resumed. Each tag stays released until resumed by name (or by a resume of all): a trainer that released
everything resumes `cuda_graph` with `kv_cache`, as slime does. `weights_drafter` (a draft model's weights) and
`cuda_graph` without decode graphs name memory this scheduler does not hold: nothing to release.

vLLM's sleep levels ask for more or less (WeightsRelease): level 1 (OFFLOAD) promises the same weights back, so
on CPU the tensors that no checkpoint holds are kept (nothing of theirs is freed); level 2 (DISCARD) keeps
nothing, not even the host copy, and resume leaves zeros until an update.
"""

import logging
from pathlib import Path

import torch
from flatwire_wire.control import MEMORY_TAGS, WeightsRelease

from services.common.memory import trim_now
from services.scheduler.kv.pool import KVPool
from services.scheduler.model.weights import ServedWeights, StagedWeights, WeightsRefused
from services.scheduler.parallel.calls import Release, Resume

log = logging.getLogger(__name__)


class MemoryOccupation:
    """What of the model's memory is released now; engine thread only."""

    def __init__(self, kv: KVPool, weights: ServedWeights, device: torch.device, model_dir: Path | None,
                 graphs: bool = False):
        """`model_dir`: the checkpoint the weights were read from (None: random, --load-format dummy); `graphs`:
        the runner captures decode graphs (--enable-cuda-graph)."""
        self.kv = kv
        self.weights = weights
        self.device = device
        self.held = {"weights", "kv_cache", *(("cuda_graph",) if graphs else ())}  # the tags of memory held here
        self.released: set[str] = set()
        self.awaiting_update = False  # resumed weights are zeros until an update brings them all
        self.source: Path | None = model_dir  # the checkpoint on disk that holds the served weights, if one does
        self._host_copies: list[torch.Tensor] = []
        self._zeros_because = ""  # why resume leaves zeros, when it does
        self._shapes: list[tuple[torch.Size, torch.dtype]] = []

    @staticmethod
    def tags_of(tags: list[str]) -> list[str]:
        """The tags asked for (none: all), checked; WeightsRefused names an unknown one."""
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise WeightsRefused(f"tags: {unknown[0]!r} is not one of {', '.join(MEMORY_TAGS)}")
        return [tag for tag in MEMORY_TAGS if tag in tags] if tags else list(MEMORY_TAGS)

    @property
    def refusal(self) -> str | None:
        """Why a new request cannot run now, or None."""
        if self.released:
            return (f"the scheduler's memory is released ({', '.join(sorted(self.released))}): "
                    "resume_memory_occupation first")
        if self.awaiting_update:
            return ("the weights were released and resumed as zeros (they came from a push or a broadcast, not "
                    "a checkpoint on disk): update every tensor (update_weights_*) before generating")
        return None

    def release(self, tags: list[str], weights: WeightsRelease = WeightsRelease.UNSPECIFIED) -> str:
        """Release `tags`, on every tensor-parallel rank; the caller has the runner forget its decode graphs (they
        read the memory released)."""
        if self.weights.ranks is not None:
            self.weights.ranks.tell(Release(tuple(tags), weights))
        done = []
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.kv.release()
            self.released.add("kv_cache")
            done.append("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            done.append(f"weights ({self._release_weights(weights)})")
            self.released.add("weights")
        if "cuda_graph" in tags and "cuda_graph" in self.held and "cuda_graph" not in self.released:
            self.released.add("cuda_graph")  # forgotten by the runner: their memory goes with them
            done.append("cuda_graph")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            trim_now()  # glibc keeps freed heap pages otherwise
        said = f"released {', '.join(done)}" if done else "nothing to release: already released"
        return said + self._not_held(tags)

    def resume(self, tags: list[str]) -> str:
        if self.weights.ranks is not None:
            self.weights.ranks.tell(Resume(tuple(tags)))
        done = []
        if "weights" in tags and "weights" in self.released:
            done.append(f"weights ({self._resume_weights()})")
            self.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.released:
            self.kv.resume()
            done.append("kv_cache")
            self.released.discard("kv_cache")
        if "cuda_graph" in tags and "cuda_graph" in self.released:
            done.append("cuda_graph (captured again when next used)")
            self.released.discard("cuda_graph")
        return (f"resumed {', '.join(done)}" if done else "nothing to resume: not released") + self._not_held(tags)

    def _not_held(self, tags: list[str]) -> str:
        missing = [tag for tag in tags if tag not in self.held]
        return f" ({', '.join(missing)}: none held here)" if missing else ""

    def updated(self, staged: StagedWeights) -> None:
        """`staged` was swapped in."""
        if staged.pairs:  # an update of no tensor (a trainer's filler for a rank with none) changed nothing
            self.source = staged.source  # a push or a broadcast (even of every tensor) is on no disk
        if staged.complete:
            self.awaiting_update = False

    def randomized(self) -> None:
        """The weights were reset to random values (weights_checker): on no disk, so resumed as zeros."""
        self.source = None

    def _release_weights(self, weights: WeightsRelease) -> str:
        """Free the weights' memory; what is kept of them for resume (WeightsRelease), said."""
        tensors = self.weights.unique_tensors()
        keep = False
        self._zeros_because = "they came from a push or a broadcast"
        if weights is WeightsRelease.DISCARD:
            self.source, kept = None, "discarded: zeros on resume until an update"
            self._zeros_because = "they were discarded"
        elif self.device.type == "cuda":
            keep, kept = True, "kept on the host"
        elif self.source is not None:
            kept = f"to be read again from {self.source}"
        elif weights is WeightsRelease.OFFLOAD:  # the tensors themselves are kept: nothing is freed
            keep, kept = True, "kept in memory: they came from a push or a broadcast, and a CPU has no lower tier"
        else:
            kept = "dropped: zeros on resume until an update (they came from a push or a broadcast)"
        with torch.no_grad():
            if keep:  # a copy from CUDA; on CPU the tensors themselves
                self._host_copies = [tensor.detach().to("cpu") for tensor in tensors]
            self._shapes = [(tensor.shape, tensor.dtype) for tensor in tensors]
            for tensor in tensors:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=self.device)
        return kept

    def _resume_weights(self) -> str:
        tensors = self.weights.unique_tensors()
        with torch.no_grad():
            if self._host_copies:
                for tensor, host in zip(tensors, self._host_copies):
                    tensor.data = host.to(self.device)
                self._host_copies = []
                return "from their host copy"
            for tensor, (shape, dtype) in zip(tensors, self._shapes):
                tensor.data = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.source is not None:
            self.weights.read_checkpoint(str(self.source), "").install_here()  # each rank resumes its own
            return f"read again from {self.source}"
        self.awaiting_update = True
        return f"zeros until the next update: {self._zeros_because}"
