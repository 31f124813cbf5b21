"""Plots for BENCHMARKS.md: response cost and body size against k and against length.

Reads bench/out/replay.json (its sweep: build + serialize CPU time and body size per
client format, at 1000 tokens for k in 0..128 and at k=128 for 125..1000 tokens,
with the copy + base64 floor of the same bytes) and writes bench/plots/*.png.

    python -m bench.plots         # after python -m bench.replay
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import OUT_DIR  # noqa: E402

PLOTS_DIR = Path(__file__).resolve().parent / "plots"
FIGURES = {
    "vs_k.png": ("k", 1000, "k (top logprobs per token), 1000 generated tokens"),
    "vs_tokens.png": ("tokens", 128, "generated tokens, k = 128"),
}


def series(sweep: list[dict], axis: str, fixed: int) -> dict[str, list[dict]]:
    """Per format, the sweep points along `axis` with the other dimension at `fixed`."""
    other = "tokens" if axis == "k" else "k"
    lines: dict[str, list[dict]] = {}
    for point in sorted(sweep, key=lambda p: p[axis]):
        if point[other] == fixed:
            lines.setdefault(point["format"], []).append(point)
    return lines


def draw(sweep: list[dict], axis: str, fixed: int, label: str, path: Path) -> None:
    lines = series(sweep, axis, fixed)
    fig, (cost, size) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in lines.items():
        xs = [p[axis] for p in points]
        cost.plot(xs, [p["build_serialize"] * 1e3 for p in points], marker="o", label=name)
        size.plot(xs, [p["body_bytes"] / 1e6 for p in points], marker="o", label=name)
    floor = next(iter(lines.values()))
    xs = [p[axis] for p in floor]
    cost.plot(xs, [p["floor"] * 1e3 for p in floor], "k--", label="floor: copy + base64 of the top-k bytes")
    size.plot(xs, [4 / 3 * 8 * p["tokens"] * p["k"] / 1e6 for p in floor], "k--", label="base64 of the top-k bytes")
    cost.set(title="gateway build + serialize (CPU, per response)", xlabel=label, ylabel="ms", yscale="log")
    size.set(title="response body", xlabel=label, ylabel="MB")
    for ax in (cost, size):
        ax.grid(True, which="both", alpha=0.3)
    cost.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    sweep = json.loads((OUT_DIR / "replay.json").read_text())["results"]["sweep"]
    PLOTS_DIR.mkdir(exist_ok=True)
    paths = []
    for name, (axis, fixed, label) in FIGURES.items():
        paths.append(PLOTS_DIR / name)
        draw(sweep, axis, fixed, label, paths[-1])
    print("\n".join(str(p) for p in paths))
    return paths


if __name__ == "__main__":
    main()
