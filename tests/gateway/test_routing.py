"""The gateway's choice of scheduler replica (services/gateway/routing.py), without services: sessions and
shared prefixes stay on one replica unless it is much busier than the least loaded one."""

from dataclasses import dataclass

from services.gateway.routing import (
    BALANCE_ABS,
    BLOCK_TOKENS,
    Router,
    RoutingPolicy,
    block_hashes,
    routing_key,
)


@dataclass
class FakeReplica:
    address: str
    load: int = 0


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BLOCK_TOKENS)]


def test_block_hashes_cover_whole_blocks_and_depend_on_all_before():
    ids = prompt(1, 3)
    assert len(block_hashes(ids)) == 3 and len(block_hashes(ids + [7] * (BLOCK_TOKENS - 1))) == 3
    changed = [0] + ids[1:]
    assert all(a != b for a, b in zip(block_hashes(ids), block_hashes(changed)))  # the first token reaches all


def test_a_shared_prefix_follows_the_replica_that_was_sent_it():
    a, b = FakeReplica("a"), FakeReplica("b", load=1)
    router = Router(RoutingPolicy.CACHE_AWARE)
    system = prompt(1, 4)
    assert router.choose([a, b], system + prompt(2, 1)) is a  # least loaded
    a.load = 5
    assert router.choose([a, b], system + prompt(3, 2)) is a  # shares 4 blocks with what went to a
    assert router.choose([a, b], prompt(4, 4)) is b  # shares nothing: the least loaded
    assert router.choose([b], system) is b  # a out of rotation: never chosen
    assert (router.by_affinity, router.by_load) == (1, 3)


def test_a_much_busier_replica_is_passed_over():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router(RoutingPolicy.CACHE_AWARE)
    shared = prompt(1, 2)
    assert router.choose([a, b], shared) is a
    a.load = BALANCE_ABS  # not more than BALANCE_ABS above b
    assert router.choose([a, b], shared) is a
    a.load = BALANCE_ABS + 1
    assert router.choose([a, b], shared) is b
    assert router.choose([a, b], shared) is b  # the prefix now lives on b too, and b is where it went last


def test_a_session_key_outranks_the_prefix():
    a, b = FakeReplica("a", load=1), FakeReplica("b")
    router = Router(RoutingPolicy.CACHE_AWARE)
    shared = prompt(1, 2)
    assert router.choose([a, b], shared, routing_key="s1") is b
    b.load = 3
    assert router.choose([a, b], prompt(2, 1), routing_key="s1") is b  # no prefix in common: the session decides
    assert router.choose([a, b], shared, routing_key="s2") is b  # a new session: the prefix decides


def test_least_loaded_ignores_sessions_and_prefixes():
    a, b = FakeReplica("a"), FakeReplica("b", load=1)
    router = Router(RoutingPolicy.LEAST_LOADED)
    assert router.choose([a, b], prompt(1, 2), routing_key="s") is a
    a.load = 2
    assert router.choose([a, b], prompt(1, 2), routing_key="s") is b


def test_routing_key_headers():
    assert routing_key({"x-smg-routing-key": "k", "x-session-id": "s"}) == "k"  # SGLang's router's first
    assert routing_key({"x-session-id": "s"}) == "s"
    assert routing_key({"x-session-id": ""}) is None and routing_key({}) is None
