"""The gateway's HTTP parser and event loop: bench.capacity's streaming rows at C=512 (k=0, and k=128 flat base64)
on the defaults (httptools, uvloop) and on the pure-Python fallbacks (`--http h11 --loop asyncio`).

    python -m bench.capacity_parsers          # bench/out/capacity_parsers.md (and each variant's .json)
"""

from bench import capacity
from bench.common import OUT_DIR

VARIANTS = {"h11": "--http h11 --loop asyncio", "default": ""}


def main() -> None:
    parts = []
    for name, gateway_args in VARIANTS.items():
        capacity.main(["--concurrency", "512", "--modes", "stream", "--k", "0,128", "--formats", "flat_b64",
                       "--gateway-args", gateway_args, "--name", f"capacity_parsers_{name}"])
        parts.append((OUT_DIR / f"capacity_parsers_{name}.md").read_text().split("\n", 1)[1])
    (OUT_DIR / "capacity_parsers.md").write_text("## capacity_parsers\n" + "\n".join(parts))


if __name__ == "__main__":
    main()
