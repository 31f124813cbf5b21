"""Bursts, as an RL rollout submits its batch: bench.capacity's non-streaming k=128 flat base64 rows at C=512,
every client submitting together and again once every reply is in, against the same clients spread; with the
minimal client, an httpx.AsyncClient per client, and one AsyncClient shared by all (its pool).

    python -m bench.capacity_bursts           # writes bench/out/capacity_bursts.{md,json}
"""

from bench import capacity


def main() -> None:
    capacity.main(["--concurrency", "512", "--modes", "nonstream", "--k", "128", "--formats", "flat_b64",
                   "--output-intervals", "50", "--patterns", "spread,burst", "--clients", "raw,httpx,httpx-pool",
                   "--name", "capacity_bursts"])


if __name__ == "__main__":
    main()
