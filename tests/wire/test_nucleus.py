"""Top-p replay's layout (flatwire_wire.nucleus): the ragged block slices per request and per owner by bytes, a
request's nuclei gather entry by entry into growing buffers, and every form reads back the same nuclei."""

import numpy as np
from flatwire_wire.logprobs import I32
from flatwire_wire.nucleus import Nuclei, NucleusBlock, NucleusTrack
from flatwire_wire.steps import StepMessage

# Three requests' tokens, each token's nucleus: request 1 asked for none (no tokens in the block).
NUCLEI = [[[5, 9], [7]], [], [[1, 2, 3], [4], [0, 6]]]


def block_of(requests: list[list[list[int]]]) -> NucleusBlock:
    pieces = [(np.array([len(ids) for ids in tokens], I32).tobytes(),
               np.array([i for ids in tokens for i in ids], I32).tobytes()) for tokens in requests]
    return NucleusBlock.of_pieces([len(tokens) for tokens in requests], pieces)


def as_lists(nuclei: Nuclei) -> list[list[int]]:
    assert nuclei.offsets.dtype == nuclei.token_ids.dtype == I32 and nuclei.offsets[0] == 0
    return [nuclei.token_ids[nuclei.offsets[i]:nuclei.offsets[i + 1]].tolist() for i in range(nuclei.tokens)]


def test_a_block_reads_back_each_requests_nuclei():
    block = block_of(NUCLEI)
    assert block.tokens == [2, 0, 3]
    assert [as_lists(block.request(i)) for i in range(3)] == NUCLEI


def test_a_block_selects_requests_by_bytes():
    block = block_of(NUCLEI)
    assert block.select([0, 1, 2]) is block
    picked = block.select([2, 0])
    assert picked == block_of([NUCLEI[2], NUCLEI[0]])  # the same bytes as a block built of them
    assert [as_lists(picked.request(i)) for i in range(2)] == [NUCLEI[2], NUCLEI[0]]


def test_a_step_message_carries_and_slices_the_nuclei():
    message = StepMessage(rids=["a", "b", "c"], token_ids=[1, 2, 3, 4, 5, 6], positions=[0, 0, 4],
                          counts=[2, 1, 3], top_p=block_of(NUCLEI))
    back = StepMessage.from_bytes(message.to_bytes())
    assert back.top_p == block_of(NUCLEI)
    sliced = StepMessage.from_bytes(back.slice([2], [], [], [], ["x"]).to_bytes())
    assert sliced.top_p is not None and as_lists(sliced.top_p.request(0)) == NUCLEI[2]
    assert StepMessage(rids=["a"], token_ids=[1], positions=[0], counts=[1]).top_p is None


def test_a_track_gathers_entries_and_hands_out_views_that_stay_valid():
    """Entries arrive in position order; the ids' buffer grows past its first size, and views taken before it
    grew still read what they read."""
    track = NucleusTrack(max_tokens=6)
    big = [list(range(700)), list(range(700, 1500))]  # past the first 1024 ids
    track.add(0, block_of([[[5, 9]]]), 0)
    early = track.view(0, 1)
    track.add(1, block_of([[], big]), 1)
    track.add(3, block_of([[[2], [], [8, 1]]]), 0)  # an empty nucleus is kept as such
    assert as_lists(early) == [[5, 9]]
    assert as_lists(track.view(0, 6)) == [[5, 9], *big, [2], [], [8, 1]]
    assert as_lists(track.view(2, 4)) == [big[1], [2]]
    assert as_lists(Nuclei.concatenate([track.view(0, 2), track.view(2, 6)])) == as_lists(track.view(0, 6))
