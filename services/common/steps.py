"""Reading a StepOutput's entries: entry i carries counts[i] tokens of request rids[i], from its
output position positions[i] on, at token_ids[starts[i]:starts[i] + counts[i]]
(protos/flatwire/v1/scheduler.proto)."""

from itertools import accumulate


def token_offsets(counts) -> list[int]:
    """Where each entry's tokens start in the message's token_ids."""
    return [0, *accumulate(counts)][:len(counts)]
