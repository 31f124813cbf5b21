"""How a process's freed memory goes back to the operating system (glibc's malloc).

The gateway hands memory freed after a big request back at once; the scheduler on CPU keeps it, for the
next step's temporaries (keep_big_blocks).

glibc's malloc keeps freed memory for reuse instead of returning it: in the heap of each
thread's arena, and, once a big block (the 20 MB of a rejected body, its decoded JSON,
a tokenizer's per-token buffers) has been freed, it raises its mmap threshold up to 32
MiB so that the next big blocks come from the heap too. A gateway that has seen a few
large requests therefore stays hundreds of MB larger than it needs, each worker thread's
arena holding its own share. `trim_soon()` asks a background thread to call
`malloc_trim(0)`, which returns every arena's free pages; calls that arrive while one is
pending share it, and trims are at least TRIM_MIN_INTERVAL_S apart. Elsewhere than glibc it
does nothing.
"""

import ctypes
import ctypes.util
import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("flatwire.memory")
BIG_REQUEST_BYTES = 1 << 20  # a request at least this large is followed by a trim
TRIM_DELAY_S = 0.2
TRIM_MIN_INTERVAL_S = 0.5  # a trim takes ~20-40 ms of malloc's locks on a fragmented heap: not more often
MMAP_THRESHOLD_BYTES = 1 << 20
MMAP_THRESHOLD_MAX = 32 << 20  # the most glibc takes for M_MMAP_THRESHOLD on 64-bit
KEPT_FREE_BYTES = 1 << 30
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)

_libc = None
_malloc_trim: Callable[[int], int] | None = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _malloc_trim = _libc.malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError):  # not glibc
    _libc = _malloc_trim = None

_wanted = threading.Event()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's generations (gc.freeze): a service's
    startup leaves hundreds of thousands of long-lived objects (its libraries' modules, the tokenizer, the token
    table), which every full collection would otherwise traverse again while requests wait."""
    gc.collect()
    gc.freeze()


def use_mmap_for_big_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Have malloc serve every block of `threshold` bytes or more with its own mmap, unmapped when
    freed, instead of letting its threshold climb to 32 MiB after the first big free: a rejected
    20 MB body, its decoded JSON and text then go straight back to the OS, from whichever thread's
    arena. Call once at startup; False elsewhere than glibc."""
    if _libc is None or not hasattr(_libc, "mallopt"):
        return False
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, threshold))


def keep_big_blocks(kept_free: int = KEPT_FREE_BYTES) -> bool:
    """The opposite, for a process that allocates and frees the same big temporaries every step (the
    scheduler on CPU: torch's [batch, vocab] logits and what sampling makes of them): serve blocks up to
    32 MiB from the heap, and keep up to `kept_free` bytes of freed memory for the next step, instead of
    mapping fresh pages for each block and faulting them in (3x the time of a [16, 248k] elementwise op on
    this project's 2-core test machine). Call once at startup; False elsewhere than glibc."""
    if _libc is None or not hasattr(_libc, "mallopt"):
        return False
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and _libc.mallopt(M_TRIM_THRESHOLD, kept_free))


def trim_now() -> None:
    if _malloc_trim is not None:
        _malloc_trim(0)


def _trimmer() -> None:
    while True:
        _wanted.wait()
        time.sleep(TRIM_DELAY_S)  # let the request that asked finish freeing its buffers; later asks join in
        _wanted.clear()
        try:
            trim_now()
        except Exception:  # never let the trimmer die
            log.exception("malloc_trim failed")
        time.sleep(TRIM_MIN_INTERVAL_S)


def trim_soon() -> None:
    """Return free memory to the OS shortly, off the caller's thread (safe from any thread)."""
    global _thread
    if _malloc_trim is None:
        return
    if _thread is None:
        with _start_lock:
            if _thread is None:
                _thread = threading.Thread(target=_trimmer, name="malloc-trim", daemon=True)
                _thread.start()
    _wanted.set()
