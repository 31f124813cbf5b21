"""Shared benchmark helpers: timing (medians of repeats), progress, tables, output files.

Every benchmark in bench/ times with `measure`, reports with `Table`, and writes
bench/out/<name>.md and bench/out/<name>.json with `write_results`, so the lead
can assemble BENCHMARKS.md from the same files. Machines are noisy: report medians
and ratios from the same run, never single timings.
"""

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

OUT_DIR = Path(__file__).resolve().parent / "out"


@dataclass
class Timing:
    """Seconds per call: the median over repeats, each repeat averaging `number` calls."""

    median: float
    low: float
    high: float
    repeats: int
    number: int

    @property
    def ms(self) -> float:
        return self.median * 1e3

    @property
    def us(self) -> float:
        return self.median * 1e6


def timing_of(per_call: list[float], number: int = 1) -> Timing:
    """A Timing from per-call seconds measured elsewhere (one entry per repeat)."""
    return Timing(statistics.median(per_call), min(per_call), max(per_call), len(per_call), number)


def calibrate(fn: Callable[[], Any], min_time: float = 0.02) -> int:
    """Calls per timed run so that one run lasts at least `min_time` (like timeit's
    autorange), which keeps microsecond calls above the clock's noise."""
    fn()  # warm caches and lazy imports outside the timed runs
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        if time.perf_counter() - start >= min_time:
            return number
        number *= 4


def time_calls(fn: Callable[[], Any], number: int) -> float:
    """Seconds per call over `number` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def measure(fn: Callable[[], Any], repeats: int = 5, min_time: float = 0.02) -> Timing:
    """Time `fn()` alone: `repeats` runs of a calibrated number of calls, per-call median."""
    number = calibrate(fn, min_time)
    return timing_of([time_calls(fn, number) for _ in range(repeats)], number)


class Interleaved:
    """Many cases timed in rounds: each round runs every case once (a calibrated
    number of calls), so a burst of load from other processes spreads over all
    cases instead of skewing one of them; report the median over rounds.

    Timings measured elsewhere (a streamed run, say) join with `record`.
    """

    def __init__(self, min_time: float = 0.02):
        self.min_time = min_time
        self.cases: dict[Any, tuple[Callable[[], Any], int]] = {}
        self.runs: dict[Any, list[float]] = {}
        self.numbers: dict[Any, int] = {}

    def add(self, key: Any, fn: Callable[[], Any]) -> None:
        self.cases[key] = (fn, calibrate(fn, self.min_time))

    def round(self) -> None:
        for key, (fn, number) in self.cases.items():
            self.record(key, time_calls(fn, number), number)

    def record(self, key: Any, seconds_per_call: float, number: int = 1) -> None:
        self.runs.setdefault(key, []).append(seconds_per_call)
        self.numbers[key] = number

    def timing(self, key: Any) -> Timing:
        return timing_of(self.runs[key], self.numbers[key])


class Progress:
    """One line per step on stderr, with the step count and the time so far."""

    def __init__(self, total: int, name: str):
        self.total, self.name, self.done = total, name, 0
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        print(f"[{self.name} {self.done}/{self.total} {elapsed:6.1f}s] {what}", file=sys.stderr, flush=True)


class Table:
    """A titled markdown table; cells are preformatted strings (see fmt_*)."""

    def __init__(self, title: str, columns: list[str], note: str = ""):
        self.title, self.columns, self.note = title, columns, note
        self.rows: list[list[str]] = []

    def add(self, *cells: Any) -> None:
        assert len(cells) == len(self.columns), (cells, self.columns)
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


def fmt_time(seconds: float) -> str:
    """Milliseconds for >= 1 ms, microseconds below (what a reader compares)."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def fmt_bytes(n: int) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.2f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{n} B"


def fmt_ratio(x: float) -> str:
    return f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def machine() -> dict[str, Any]:
    """What BENCHMARKS.md states about the machine and the library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for package in ("numpy", "grpcio", "protobuf", "torch", "transformers", "triton"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    torch = sys.modules.get("torch")  # imported by the benchmarks that use a device; not imported here
    gpu = torch.cuda.get_device_name() if torch is not None and torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "os": platform.platform(), "load_average_1m": round(os.getloadavg()[0], 2),
            **({"gpu": gpu} if gpu else {}), **versions}


def machine_line() -> str:
    m = machine()
    libs = ", ".join(f"{k} {v}" for k, v in m.items()
                     if k not in ("cpu", "cores", "os", "python", "load_average_1m", "gpu"))
    gpu = f", GPU {m['gpu']}" if "gpu" in m else ""
    # The load says how much other work shared the cores while this ran.
    return (f"{m['cpu']}, {m['cores']} cores{gpu}, Python {m['python']}, {libs}; "
            f"load average {m['load_average_1m']} at the end")


def write_results(name: str, command: str, tables: list[Table], data: dict[str, Any], notes: str = "") -> str:
    """Write bench/out/<name>.md (tables) and <name>.json (numbers for plots); return the markdown."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    parts = [f"## {name}", "", f"Command: `{command}`  ", f"Machine: {machine_line()}", ""]
    if notes:
        parts += [notes, ""]
    parts += [table.markdown() for table in tables]
    text = "\n".join(parts)
    (OUT_DIR / f"{name}.md").write_text(text)
    payload = {"name": name, "command": command, "machine": machine(), "results": data}
    (OUT_DIR / f"{name}.json").write_text(json.dumps(payload, indent=1, default=_jsonable))
    return text


def _jsonable(value: Any) -> Any:
    if isinstance(value, Timing):
        return asdict(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
