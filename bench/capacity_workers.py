"""Streaming at scale with the gateway spread over processes: bench.capacity's streaming rows at C=512 (k=0, and
k=128 flat base64) with 1, 2 and 4 gateway processes behind one port, as many as this host has cores for.

    python -m bench.capacity_workers          # writes bench/out/capacity_workers.{md,json}
"""

import os

from bench import capacity


def main() -> None:
    workers = [n for n in (1, 2, 4) if n <= (os.cpu_count() or 1)]
    capacity.main(["--concurrency", "512", "--modes", "stream", "--k", "0,128", "--formats", "flat_b64",
                   "--gateway-workers", ",".join(map(str, workers)), "--name", "capacity_workers"])


if __name__ == "__main__":
    main()
