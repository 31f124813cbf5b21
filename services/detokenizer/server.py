"""The detokenizer process: consumes every scheduler's steps, serves StreamOutputs per owner.

gRPC health is SERVING only while the step stream of every scheduler replica is
subscribed, so a gateway that checks it knows the whole path is up.

Nothing is dropped on a cut: a scheduler stream that breaks is resubscribed and the
scheduler replays what was missed (its requests here are kept meanwhile); a gateway
that goes away finds its outputs in its outbox when it comes back. Only past a
grace period does the detokenizer give up: a scheduler that stays away or restarts
has its requests failed (FINISH_REASON_ERROR) to their gateways; a gateway that
stays away has its requests aborted in their schedulers, which nobody would read.
"""

import asyncio
import logging
import time
import uuid

import grpc
from flatwire_wire.detokenizer import DETOKENIZER, StreamOutputsRequest
from flatwire_wire.scheduler import AbortRequest
from flatwire_wire.steps import FinishReason, StepMessage
from grpc_health.v1 import health_pb2

from services.common.auth import resolve_internal_secret
from services.common.config import parse_config
from services.common.discovery import INSTANCE_METADATA, subscription_health_name
from services.common.logs import setup_logging
from services.common.model_store import cache_root, resolve_model
from services.common.rpc import add_health, create_server, listen
from services.common.signals import stop_requested
from services.detokenizer.batch_decode import load_batch_decoder
from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.router import Router
from services.detokenizer.scheduler_streams import SchedulerStreams

log = logging.getLogger("flatwire.detokenizer")
SERVICE_NAME = DETOKENIZER.name
HEALTH_POLL_S = 0.1
BACKPRESSURE_POLL_S = 0.002
WATCH_INTERVAL_S = 0.5


class DetokenizerService:
    """The Detokenizer service (flatwire_wire.detokenizer.DetokenizerServicer)."""

    def __init__(self, router: Router):
        self.router = router
        self.instance_id = uuid.uuid4().hex

    async def stream_outputs(self, request: StreamOutputsRequest, context):
        if not request.owner:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "owner: required (the subscribing gateway's id)")
        queue = self.router.subscribe(request.owner)
        try:
            # Sent at once (not with the first output), so the subscriber's wait_for_connection()
            # returns as soon as it is routed to; the instance id tells it whether this process is the
            # one it followed before (a cut stream may have lost messages) or a new one (which replays).
            await context.send_initial_metadata(((INSTANCE_METADATA, self.instance_id),))
            while (message := await queue.get()) is not None:  # None: a newer subscription took over
                yield message
        finally:
            self.router.unsubscribe(request.owner, queue)


class Relay:
    """Steps in from every scheduler replica, each owner's outputs and stop-string aborts out."""

    def __init__(self, manager: DetokenizerManager, router: Router, config: DetokenizerConfig):
        self.manager = manager
        self.router = router
        self.config = config
        self.streams = SchedulerStreams(config, self.on_step, self.on_step_failed, self.on_lost, self.on_restarted)
        self._lost_since: dict[str, float] = {}  # scheduler -> when its stream broke

    async def on_step(self, step: StepMessage, scheduler: str) -> None:
        self._lost_since.pop(scheduler, None)
        for part in self.manager.expand(step):
            owned, aborts = self.manager.process(part, scheduler)
            for abort in aborts:
                self.streams.abort(scheduler, abort)
            self.router.publish(owned)
        await self._wait_for_room()

    async def _wait_for_room(self) -> None:
        """Back-pressure: while a connected gateway has more than --max-outbox-messages waiting, read no more
        steps (the scheduler's stream to here fills, and the scheduler slows down). A gateway that stays behind
        for --stall-timeout-s is cut instead, so that one stuck gateway cannot stop the others for good."""
        deadline = time.monotonic() + self.config.stall_timeout_s
        while slow := self.router.congested(self.config.max_outbox_messages):
            if time.monotonic() > deadline:
                for owner in slow:
                    log.warning("gateway %s stayed %.0fs behind: ending its stream", owner,
                                self.config.stall_timeout_s)
                    self.router.cut(owner)
                return
            await asyncio.sleep(BACKPRESSURE_POLL_S)

    def on_step_failed(self, step: StepMessage, scheduler: str) -> None:
        """Processing the step raised (a bug): its requests' state here is in doubt, so they fail and stop."""
        owned = self.manager.fail(step.touched_rids(), f"detokenizer: failed to process a step of scheduler "
                                                       f"{scheduler}")
        self.router.publish(owned)
        for _, finish in owned.finished:
            self.streams.abort(scheduler, AbortRequest(rid=finish.rid, reason=FinishReason.ERROR,
                                                       message=finish.message))

    def on_lost(self, scheduler: str) -> None:
        """Its stream broke: keep its requests, the resubscription replays what they miss."""
        self._lost_since.setdefault(scheduler, time.monotonic())

    def on_restarted(self, scheduler: str) -> None:
        self._drop_scheduler(scheduler, f"scheduler {scheduler} restarted: its running requests were lost")

    async def watch(self) -> None:
        """Give up on schedulers and gateways that stay away past their grace periods."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            for scheduler, since in list(self._lost_since.items()):
                if now - since > self.config.scheduler_grace_s:
                    self._drop_scheduler(scheduler, f"lost the step stream of scheduler {scheduler} for "
                                                    f"{self.config.scheduler_grace_s:.0f}s")
            for owner in self.router.away(self.config.owner_grace_s):
                self._abandon(owner)

    def _drop_scheduler(self, scheduler: str, why: str) -> None:
        self._lost_since.pop(scheduler, None)
        owned = self.manager.drop_scheduler(scheduler, why)
        if owned.finished:
            log.warning("%s: failing its %d requests", why, len(owned.finished))
        self.router.publish(owned)

    def _abandon(self, owner: str) -> None:
        """A gateway gone past the grace period: stop its requests (a dead gateway's requests would
        otherwise run to max_new_tokens) and drop what waits for it."""
        requests = self.manager.drop_owner(owner)
        if requests:
            log.warning("gateway %s gone for %.0fs: aborting its %d requests", owner, self.config.owner_grace_s,
                        len(requests))
        # An error, not an abort: were the gateway alive after all (following another detokenizer), it must not
        # take the cut-short output for its client's own abort.
        why = f"detokenizer: gateway {owner} was not subscribed for {self.config.owner_grace_s:.0f}s"
        for rid, scheduler in requests:
            self.streams.abort(scheduler, AbortRequest(rid=rid, reason=FinishReason.ERROR, message=why))
        self.router.forget(owner)


async def _report_health(streams: SchedulerStreams, servicer) -> None:
    """Overall, and per scheduler replica (subscription_health_name), for the gateways' balancing."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    last: dict[str, int] = {}
    while True:
        overall = serving if streams.all_connected() else not_serving
        current = {"": overall, SERVICE_NAME: overall} | {
            subscription_health_name(address): serving if subscribed else not_serving
            for address, subscribed in streams.subscriptions().items()}
        current |= {name: not_serving for name in last.keys() - current.keys()}  # replicas gone
        for name, status in current.items():
            if last.get(name) != status:
                await servicer.set(name, status)
        last = current
        await asyncio.sleep(HEALTH_POLL_S)


async def serve(config: DetokenizerConfig) -> None:
    resolve_internal_secret(config, log)
    decode = load_batch_decoder(resolve_model(config.model, config.cache_dir), cache_root(config.cache_dir))
    router = Router(adopt_for_s=config.owner_grace_s)
    relay = Relay(DetokenizerManager(decode), router, config)

    server = create_server(config.max_message_mb, config.keepalive_s, internal_secret=config.internal_secret,
                           max_receive_mb=config.max_request_mb)
    DETOKENIZER.add_to(server, DetokenizerService(router))
    health = add_health(server)  # no reflection: an internal API
    address = f"{config.host}:{config.port}"
    listen(server, address, config.tls.internal_server())
    await server.start()
    tasks = [asyncio.create_task(relay.streams.run()), asyncio.create_task(relay.watch()),
             asyncio.create_task(_report_health(relay.streams, health))]
    log.info("detokenizer serving on %s; schedulers %s", address, ", ".join(config.schedulers))

    await stop_requested()
    log.info("stopping")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    router.close()  # the gateways' streams end, rather than being cancelled by the server's stop
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    config = parse_config(DetokenizerConfig, argv, prog)
    setup_logging(config.log_level, "detokenizer")
    if not config.schedulers:
        raise SystemExit("--schedulers: at least one scheduler address is required")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
