"""A step subscriber that registers with a scheduler, then never reads (the scheduler's writes to it back up):
`python -m harness.stalled_subscriber ADDRESS`; it prints "subscribed" and waits to be killed."""

import sys
import time

import grpc
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER


def main() -> None:
    channel = grpc.insecure_channel(sys.argv[1])
    stream = SCHEDULER.calls(channel)["StreamSteps"](EMPTY)
    stream.initial_metadata()  # registered: every step from now on is written to it
    print("subscribed", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
