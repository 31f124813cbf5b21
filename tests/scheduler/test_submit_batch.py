"""Submits batched as they are made (flatwire_wire.submit_batch) against a real scheduler: a burst costs a few
SubmitBatch calls, the first of which leave while the burst is still being made, each request still gets the answer
a Submit of it alone would have, a submitter that leaves while its batch is in flight has its accepted request
handed back to be aborted, and a scheduler without SubmitBatch is sent unary Submits."""

import asyncio
import concurrent.futures
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from flatwire_wire.rpc import FIELD_METADATA
from flatwire_wire.scheduler import SCHEDULER, AbortRequest, SamplingParams, SchedulerClient, TokenizedRequest
from flatwire_wire.submit_batch import SEND_AT, SubmitBatcher

PROMPT = list(range(1000, 1016))


@pytest.fixture(scope="module")
def synthetic_scheduler(start_service) -> str:
    _, address = start_service("scheduler", "--engine", "synthetic", "--step-ms", "5",
                               "--max-running-requests", "64")
    return address


def request(rid: str | None = None, **sampling) -> TokenizedRequest:
    return TokenizedRequest(rid=rid or uuid.uuid4().hex, owner="submit-batch-test", input_ids=PROMPT,
                            sampling=SamplingParams(**{"max_new_tokens": 2, **sampling}))


@asynccontextmanager
async def client_of(address: str, **options) -> AsyncIterator[SchedulerClient]:
    async with grpc.aio.insecure_channel(address) as channel:
        with grpc.insecure_channel(address) as submit_channel:
            client = SchedulerClient(channel, submit_channel, **options)
            while not client._submit_channel_ready:  # batches of SEND_AT start on it once it is connected
                await asyncio.sleep(0.01)
            yield client


async def outcome(client: SchedulerClient, req: TokenizedRequest) -> grpc.aio.AioRpcError | None:
    try:
        await client.submit(req, timeout=30)
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


def test_a_burst_is_a_few_calls_and_each_request_gets_its_own_answer(synthetic_scheduler):
    async def burst():
        async with client_of(synthetic_scheduler) as client:
            await client.submit(request(rid="lone"), timeout=30)  # a lone submit goes out at once
            good = [request() for _ in range(300)]
            bad = request(temperature=-1.0)
            long = request(max_new_tokens=100_000)  # still running when its rid comes again
            burst = [long] + good[:100] + [bad] + good[100:] + [request(rid=long.rid)]
            results = await asyncio.gather(*(outcome(client, req) for req in burst))
            await client.abort(AbortRequest(rid=long.rid), timeout=30)
            return client._submits.calls, results, burst, bad

    calls, results, burst, bad = asyncio.run(burst())
    assert calls <= 1 + 303 // SEND_AT + 1, calls  # the lone one, then 303 requests in batches of SEND_AT and the rest
    by_rid = dict(zip((req.rid for req in burst[:-1]), results[:-1]))
    assert all(by_rid[req.rid] is None for req in burst[:-1] if req is not bad)
    refused = by_rid[bad.rid]
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("sampling.temperature:")
    assert dict(refused.trailing_metadata())[FIELD_METADATA] == "sampling.temperature"
    duplicate = results[-1]
    assert duplicate.code() == grpc.StatusCode.ALREADY_EXISTS
    assert dict(duplicate.trailing_metadata())[FIELD_METADATA] == "rid"


def test_a_burst_leaves_in_batches_while_it_is_being_made(synthetic_scheduler):
    """Every SEND_AT submits made in one turn of the loop leave at once, before the submitters after them run (a
    gateway is still parsing a burst's later requests then); the rest leave at the end of the turn."""

    async def burst():
        async with client_of(synthetic_scheduler) as client:
            started_before: list[int] = []  # SubmitBatch calls started when each submitter ran

            async def submit(req: TokenizedRequest) -> None:
                started_before.append(client._submits.calls)
                await client.submit(req, timeout=30)

            await asyncio.gather(*(submit(request()) for _ in range(2 * SEND_AT + 5)))
            return started_before, client._submits.calls

    started_before, calls = asyncio.run(burst())
    assert started_before[SEND_AT - 1] == 0 and started_before[SEND_AT] == 1 and started_before[2 * SEND_AT] == 2
    assert calls == 3


def test_a_request_grpc_cannot_serialize_fails_alone(synthetic_scheduler):
    """A value out of its field's range cannot be encoded: that request goes alone, as a unary Submit (gRPC sends it
    empty: the scheduler names its rid), and only it is refused."""

    async def mixed():
        async with client_of(synthetic_scheduler) as client:
            await client.submit(request(), timeout=30)
            good = [request() for _ in range(5)]
            bad = request()
            bad.routed_experts_start_len = 2**40  # a uint32
            return await asyncio.gather(*(outcome(client, req) for req in [*good[:2], bad, *good[2:]]))

    results = asyncio.run(mixed())
    assert [result is None for result in results] == [True, True, False, True, True, True]
    assert results[2].code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_submitter_that_leaves_mid_call_gets_its_request_aborted(synthetic_scheduler):
    async def leave():
        orphans: list[str] = []
        async with client_of(synthetic_scheduler, orphaned=orphans.append) as client:
            first = asyncio.create_task(client.submit(request(max_new_tokens=2000), timeout=30))
            while not client._submits.calls:  # the first's call is in flight
                await asyncio.sleep(0)
            queued_req = request(max_new_tokens=2000)
            queued = asyncio.create_task(client.submit(queued_req, timeout=30))
            await asyncio.sleep(0)  # queued, to leave at the end of this turn of the loop
            first.cancel()
            queued.cancel()
            await asyncio.gather(first, queued, return_exceptions=True)
            for _ in range(100):
                if orphans:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # the queued one, had it been sent, would be back by now
            for rid in orphans:  # running, as the caller must abort it: Abort answers OK, not NOT_FOUND
                await client.abort(AbortRequest(rid=rid), timeout=10)
            return orphans, queued_req.rid

    orphans, queued_rid = asyncio.run(leave())
    assert len(orphans) == 1 and orphans[0] != queued_rid  # the sent one comes back; the unsent one never left


def test_a_scheduler_without_submit_batch_gets_unary_submits(synthetic_scheduler):
    """An older scheduler mid-upgrade: a server with Submit alone, passing it on to the real scheduler."""

    async def older():
        async with grpc.aio.insecure_channel(synthetic_scheduler) as upstream:
            forward = SCHEDULER.calls(upstream)["Submit"]

            async def submit(req, context):
                try:
                    return await forward(req, timeout=30)
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), exc.details(), trailing_metadata=tuple(exc.trailing_metadata()))

            method = SCHEDULER.methods["Submit"]  # its only method: SubmitBatch is UNIMPLEMENTED, as gRPC answers
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SCHEDULER.name, {
                "Submit": grpc.unary_unary_rpc_method_handler(
                    submit, request_deserializer=method.decode_request,
                    response_serializer=method.encode_response)}),))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                async with client_of(f"127.0.0.1:{port}") as client:
                    reqs = [request() for _ in range(20)] + [request(top_p=0.0)]
                    first = await asyncio.gather(*(outcome(client, req) for req in reqs))
                    later = await outcome(client, request())
                    return client._submits.calls, first, later
            finally:
                await server.stop(None)

    calls, first, later = asyncio.run(older())
    assert calls == 1  # tried once, then unary for good
    assert all(result is None for result in first[:-1]) and later is None
    assert first[-1].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(first[-1].trailing_metadata())[FIELD_METADATA] == "sampling.top_p"


def test_a_blocking_call_that_ends_cancelled_fails_its_submits():
    """A batch's blocking call that ends cancelled (its channel closed mid-call, as when a replica is dropped) fails
    each of its submits with UNAVAILABLE instead of leaving them waiting. (A closed channel cannot be timed to a
    call in flight, hence a cancelled future for the call.)"""

    def cancelled_call(message: bytes, timeout: float | None) -> concurrent.futures.Future:
        call: concurrent.futures.Future = concurrent.futures.Future()
        call.cancel()
        return call

    async def not_sent(*args):
        raise AssertionError("the batch of SEND_AT goes on the blocking channel")

    async def burst():
        batcher = SubmitBatcher(not_sent, lambda request: b"", not_sent, start_batch=cancelled_call)
        return await asyncio.wait_for(
            asyncio.gather(*(batcher.submit(i, 5) for i in range(SEND_AT)), return_exceptions=True), 10)

    outcomes = asyncio.run(burst())
    assert [o.code() if hasattr(o, "code") else o for o in outcomes] == [grpc.StatusCode.UNAVAILABLE] * SEND_AT
