"""Bursts, as an RL rollout submits its batch: bench.capacity's non-streaming k=128 flat base64 rows at C=512,
every client submitting together and again once every reply is in, against the same clients spread; with the
minimal client, an httpx.AsyncClient per client, and one AsyncClient shared by all (its pool). Each burst row has
its floor beside it (bench.burst_floor): the same clients and rounds against a bare ASGI app that only waits the
generation's time and answers as many bytes.

    python -m bench.capacity_bursts           # writes bench/out/capacity_bursts.{md,json}
"""

from bench import burst_floor, capacity


def main() -> None:
    parser, args = capacity.parse(["--concurrency", "512", "--modes", "nonstream", "--k", "128", "--formats",
                                   "flat_b64", "--output-intervals", "50", "--patterns", "spread,burst", "--clients",
                                   "raw,httpx,httpx-pool", "--name", "capacity_bursts"])
    rows = capacity.run(args)
    floors = [burst_floor.measure(row, args) for row in rows if row["pattern"] == "burst"]
    capacity.report(parser, args, rows, "python -m bench.capacity_bursts", (burst_floor.table(floors, args),),
                    " The floor table: bench.burst_floor.", {"floors": floors})


if __name__ == "__main__":
    main()
