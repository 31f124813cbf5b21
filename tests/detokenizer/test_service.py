"""The detokenizer service between a real scheduler and subscribing owners (processes on loopback)."""

import asyncio
import uuid
from collections.abc import Iterator

import grpc
import pytest
from flatwire_wire.detokenizer import DetokenizerClient
from flatwire_wire.scheduler import LogprobParams, SamplingParams, SchedulerClient, TokenizedRequest
from flatwire_wire.steps import DetokenizeParams, FinishReason, StepMessage
from transformers import AutoTokenizer

from harness.procs import ServiceProcess
from services.common.rpc import create_channel

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def detokenizer_address(start_service, scheduler_address) -> Iterator[str]:
    """A second detokenizer of the session scheduler, for this module only: left running, it would see the
    session gateway's requests, which never subscribes to it, and abort them past its --owner-grace-s."""
    proc, address = start_service("detokenizer", "--schedulers", scheduler_address)
    yield address
    proc.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


class Peers:
    """Stubs for the scheduler and the detokenizer on one event loop."""

    def __init__(self, scheduler_address: str, detokenizer_address: str):
        self.channels = [create_channel(scheduler_address, 256), create_channel(detokenizer_address, 256)]
        self.scheduler = SchedulerClient(self.channels[0])
        self.detokenizer = DetokenizerClient(self.channels[1])

    async def owner_stream(self, owner: str):
        call = self.detokenizer.stream_outputs(owner)
        await call.wait_for_connection()  # the detokenizer answers once the owner is routed to
        return call

    async def scheduler_stream(self):
        call = self.scheduler.stream_steps()
        # Answered after the stream was opened on the same connection: the subscriber is registered.
        await self.scheduler.model_info()
        return call

    async def submit(self, owner: str, prompt: list[int], max_new_tokens: int = 16, seed: int = 1,
                     top_k: int = 0, prompt_logprobs: bool = False, stream_interval: int = 1, **detokenize) -> str:
        rid = f"detok-test-{uuid.uuid4().hex[:8]}"
        await self.scheduler.submit(TokenizedRequest(
            rid=rid, owner=owner, input_ids=prompt, stream_interval=stream_interval,
            sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed),
            logprob=LogprobParams(return_logprob=top_k > 0, top_logprobs_num=top_k,
                                  logprob_start_len=0 if prompt_logprobs else -1),
            detokenize=DetokenizeParams(**detokenize)), timeout=30)
        return rid

    async def close(self):
        for channel in self.channels:
            await channel.close()


async def until_finished(call, rids: set[str]) -> list[StepMessage]:
    """The stream's messages up to the one where the last of `rids` finished."""
    pending, messages = set(rids), []

    async def read():
        async for message in call:
            messages.append(message)
            pending.difference_update(f.rid for f in message.finished)
            if not pending:
                return

    await asyncio.wait_for(read(), TIMEOUT_S)
    return messages


def per_request(messages) -> dict[str, dict]:
    """rid -> its token ids, texts and finish, in stream order."""
    out: dict[str, dict] = {}
    for message in messages:
        for i, (rid, text) in enumerate(zip(message.rids, message.texts or [""] * len(message.rids))):
            entry = out.setdefault(rid, {"ids": [], "text": "", "finish": None})
            entry["ids"] += message.entry_tokens(i)
            entry["text"] += text
        for finish in message.finished:
            out.setdefault(finish.rid, {"ids": [], "text": "", "finish": None})["finish"] = finish
    return out


def run(coroutine_fn, scheduler_address, detokenizer_address):
    async def main():
        peers = Peers(scheduler_address, detokenizer_address)
        try:
            return await coroutine_fn(peers)
        finally:
            await peers.close()
    return asyncio.run(main())


PROMPTS = [[9707, 11, 1879, 0], [100, 200, 300], [5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("stream_interval", [1, 5, 0])  # a token per entry, 5, the scheduler's 50 (the whole output)
def test_texts_concatenate_to_the_decode_of_the_output_ids(scheduler_address, detokenizer_address, tokenizer,
                                                           stream_interval):
    async def scenario(peers: Peers):
        call = await peers.owner_stream("gw-text")
        rids = [await peers.submit("gw-text", prompt, max_new_tokens=24, seed=n, skip_special_tokens=True,
                                   stream_interval=stream_interval)
                for n, prompt in enumerate(PROMPTS)]
        return rids, per_request(await until_finished(call, set(rids)))

    rids, got = run(scenario, scheduler_address, detokenizer_address)
    for rid in rids:
        assert got[rid]["finish"].reason in (FinishReason.LENGTH, FinishReason.STOP_TOKEN)
        assert got[rid]["ids"], rid
        assert got[rid]["text"] == tokenizer.decode(got[rid]["ids"], skip_special_tokens=True)


def test_top_k_bytes_arrive_exactly_as_the_scheduler_sent_them(scheduler_address, detokenizer_address):
    async def scenario(peers: Peers):
        direct = await peers.scheduler_stream()
        routed = await peers.owner_stream("gw-bytes")
        rids = [await peers.submit("gw-bytes", prompt, max_new_tokens=6, seed=n, top_k=(n + 1) * 7,
                                   prompt_logprobs=True) for n, prompt in enumerate(PROMPTS)]
        return rids, await until_finished(direct, set(rids)), await until_finished(routed, set(rids))

    rids, direct, routed = run(scenario, scheduler_address, detokenizer_address)

    def bytes_by_rid(messages, rid_field, block_field):
        out: dict[str, bytes] = {}
        for message in messages:
            block = getattr(message, block_field)
            if block is None:
                continue
            for i, rid in enumerate(getattr(message, rid_field)):
                part = block.request(i)
                out[rid] = out.get(rid, b"") + b"".join(
                    a.tobytes() for a in (part.token_logprobs, part.topk_values, part.topk_ids))
        return out

    for rid_field, block_field in (("rids", "output"), ("prompt_rids", "prompt")):
        sent, received = bytes_by_rid(direct, rid_field, block_field), bytes_by_rid(routed, rid_field, block_field)
        assert set(received) == set(rids)
        for rid in rids:
            assert len(sent[rid]) > 0 and received[rid] == sent[rid], (rid, block_field)


def test_each_owner_receives_only_its_own_requests(scheduler_address, detokenizer_address):
    async def scenario(peers: Peers):
        calls = {owner: await peers.owner_stream(owner) for owner in ("gw-one", "gw-two")}
        mine = {"gw-one": set(), "gw-two": set()}
        for n, prompt in enumerate(PROMPTS * 2):
            owner = "gw-one" if n % 2 else "gw-two"
            mine[owner].add(await peers.submit(owner, prompt, max_new_tokens=8, seed=n, top_k=3))
        got = {owner: await until_finished(call, mine[owner]) for owner, call in calls.items()}
        return mine, got

    mine, got = run(scenario, scheduler_address, detokenizer_address)
    for owner, messages in got.items():
        seen = set()
        for message in messages:
            seen.update(message.rids, message.prompt_rids, (s.rid for s in message.started),
                        (f.rid for f in message.finished))
            assert len(message.texts) == len(message.rids) == len(message.token_ids) == len(message.output.rows)
        assert seen == mine[owner]


def test_a_stop_string_ends_the_request_and_the_scheduler_stops_it(scheduler_address, detokenizer_address,
                                                                    tokenizer):
    prompt, seed = PROMPTS[0], 1234

    async def free_run(peers: Peers):
        call = await peers.owner_stream("gw-stop")
        rid = await peers.submit("gw-stop", prompt, max_new_tokens=24, seed=seed)
        return per_request(await until_finished(call, {rid}))[rid]

    reference = run(free_run, scheduler_address, detokenizer_address)
    # A stop string that starts inside the 6th token and ends inside the 8th.
    before = len(tokenizer.decode(reference["ids"][:5]))
    after = len(tokenizer.decode(reference["ids"][:8]))
    stop = reference["text"][before + 1:after - 1]
    assert stop and not any(stop in tokenizer.decode([t]) for t in reference["ids"])
    expected = reference["text"][:reference["text"].find(stop)]
    max_new_tokens = 400

    async def stopped_run(peers: Peers):
        direct = await peers.scheduler_stream()
        call = await peers.owner_stream("gw-stop")
        rid = await peers.submit("gw-stop", prompt, max_new_tokens=max_new_tokens, seed=seed, stop=[stop])
        routed = per_request(await until_finished(call, {rid}))
        # Another request afterwards: the scheduler's steps up to its end show the stopped one gone.
        later = await peers.submit("gw-stop", prompt, max_new_tokens=4, seed=seed)
        return rid, routed, await until_finished(direct, {rid, later})

    rid, routed, steps = run(stopped_run, scheduler_address, detokenizer_address)
    assert routed[rid]["finish"].reason == FinishReason.STOP_STRING
    assert routed[rid]["finish"].matched_stop == stop
    assert routed[rid]["text"] == expected
    assert len(routed[rid]["ids"]) == 8, "the step that completed the match is the last one forwarded"

    ended_at = next(n for n, m in enumerate(steps) if rid in {f.rid for f in m.finished})
    finish = next(f for f in steps[ended_at].finished if f.rid == rid)
    assert finish.reason == FinishReason.STOP_STRING and finish.matched_stop == stop
    generated = sum(list(m.rids).count(rid) for m in steps)
    assert generated < max_new_tokens
    assert not any(rid in m.rids for m in steps[ended_at + 1:])


def test_subscribing_without_an_owner_is_rejected(scheduler_address, detokenizer_address):
    async def scenario(peers: Peers):
        call = peers.detokenizer.stream_outputs("")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        return error.value

    error = run(scenario, scheduler_address, detokenizer_address)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "owner" in error.details()


def test_requests_of_a_gateway_that_went_away_are_stopped_as_failed(start_service, scheduler_address):
    """An owner that unsubscribes and stays away past the grace period gets its requests stopped, as a server-side
    fault (ERROR), never as a client's abort."""
    proc, detokenizer = start_service("detokenizer", "--schedulers", scheduler_address, "--owner-grace-s", "0.5")

    async def scenario(peers: Peers):
        direct = await peers.scheduler_stream()
        call = await peers.owner_stream("gw-gone")
        rid = await peers.submit("gw-gone", PROMPTS[0], max_new_tokens=100_000)
        async for message in call:  # running
            if rid in message.rids:
                break
        call.cancel()  # the gateway is gone
        finished = await until_finished(direct, {rid})
        return rid, per_request(finished)[rid]

    try:
        rid, seen = run(scenario, scheduler_address, detokenizer)
    finally:
        proc.stop()  # with a 0.5 s grace it would stop every other owner's requests of the session scheduler
    assert seen["finish"].reason == FinishReason.ERROR and "gw-gone was not subscribed" in seen["finish"].message
    assert len(seen["ids"]) < 100_000


def test_a_gateway_that_follows_another_detokenizer_sees_the_cut_as_an_error(start_service, scheduler_address, http):
    """A detokenizer that gives up on a gateway which is alive after all (it follows another one): the gateway's
    client gets a 503, not a 200 with an output cut short and finish_reason abort."""
    proc, _ = start_service("detokenizer", "--schedulers", scheduler_address, "--owner-grace-s", "0.5")
    try:
        reply = http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {
            "max_new_tokens": 4000, "ignore_eos": True}})  # minutes: the cut comes after 0.5 s
    finally:
        proc.stop()
    assert reply.status_code == 503, reply.text[:300]
    assert "was not subscribed" in reply.text


def test_a_second_server_on_a_taken_port_does_not_start(detokenizer_address, scheduler_address, model_dir, log_dir):
    """No SO_REUSEPORT: a second server would bind the live one's port too and share its calls."""
    proc = ServiceProcess("detokenizer", ["--port", detokenizer_address.rsplit(":", 1)[1], "--model", str(model_dir),
                                          "--schedulers", scheduler_address], log_dir)
    try:
        assert proc.proc.wait(timeout=120) != 0
    finally:
        proc.stop()
    assert f"cannot listen on 127.0.0.1:{detokenizer_address.rsplit(':', 1)[1]}" in proc.log()


def test_a_detokenizer_stopped_ends_its_subscribers_streams_cleanly(start_service, scheduler_address):
    """Its subscribers' streams end (they resubscribe elsewhere, or when it is back); the server's stop had
    cancelled them, and gRPC logged each as an unhandled exception with its traceback."""
    proc, detokenizer = start_service("detokenizer", "--schedulers", scheduler_address)

    async def scenario(peers: Peers):
        call = await peers.owner_stream("gw-stopping")
        proc.proc.terminate()
        return [message async for message in call], await call.code()

    try:
        messages, code = run(scenario, scheduler_address, detokenizer)
        proc.proc.wait(timeout=30)
    finally:
        proc.stop()
    assert (messages, code) == ([], grpc.StatusCode.OK)
    assert "Traceback" not in proc.log() and "Exception not handled" not in proc.log(), proc.log()
