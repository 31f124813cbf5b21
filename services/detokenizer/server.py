"""The detokenizer process: consumes every scheduler's steps, serves StreamOutputs per owner.

gRPC health is SERVING only while the step stream of every scheduler replica is
subscribed, so a gateway that checks it knows the whole path is up.
"""

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2
from transformers import AutoTokenizer

from services.common.config import parse_config
from services.common.discovery import subscription_health_name
from services.common.logs import setup_logging
from services.common.model_store import resolve_model
from services.common.pb import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2
from services.common.rpc import add_health_and_reflection, create_server
from services.common.signals import stop_requested
from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.router import Router
from services.detokenizer.scheduler_streams import SchedulerStreams

log = logging.getLogger("flatwire.detokenizer")
SERVICE_NAME = detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name
HEALTH_POLL_S = 0.1


class DetokenizerService(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self, router: Router, on_owner_left):
        self.router = router
        self._on_owner_left = on_owner_left

    async def StreamOutputs(self, request, context):
        if not request.owner:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "owner: required (the subscribing gateway's id)")
        queue = self.router.subscribe(request.owner)
        try:
            # Sent at once (not with the first output), so the subscriber's wait_for_connection()
            # returns as soon as it is routed to.
            await context.send_initial_metadata(())
            while True:
                yield await queue.get()
        finally:
            self.router.unsubscribe(request.owner, queue)
            if not self.router.subscribed(request.owner):
                self._on_owner_left(request.owner)


class Pipeline:
    """Steps in, per-owner outputs and stop-string aborts out."""

    def __init__(self, manager: DetokenizerManager, router: Router, config: DetokenizerConfig):
        self.manager = manager
        self.router = router
        self.owner_grace_s = config.owner_grace_s
        self.streams = SchedulerStreams(config, self.on_step, self.on_lost)
        self._abandoning: dict[str, asyncio.Task] = {}

    def on_step(self, step: scheduler_pb2.StepOutput, scheduler: str) -> None:
        owned, aborts = self.manager.process(step, scheduler)
        for abort in aborts:
            self.streams.abort(scheduler, abort)
        self.router.publish(owned)

    def on_lost(self, scheduler: str) -> None:
        self.router.publish(self.manager.drop_scheduler(scheduler))

    def on_owner_left(self, owner: str) -> None:
        """A gateway unsubscribed: unless it is back within the grace period, stop its requests,
        which nobody would read (a dead gateway's requests would otherwise run to max_new_tokens)."""
        if owner not in self._abandoning:
            task = asyncio.create_task(self._abandon(owner))
            self._abandoning[owner] = task
            task.add_done_callback(lambda _: self._abandoning.pop(owner, None))

    async def _abandon(self, owner: str) -> None:
        await asyncio.sleep(self.owner_grace_s)
        if self.router.subscribed(owner):
            return
        requests = self.manager.requests_of(owner)
        if requests:
            log.warning("gateway %s gone for %.0fs: aborting its %d requests", owner, self.owner_grace_s,
                        len(requests))
        for rid, scheduler in requests:
            self.streams.abort(scheduler, scheduler_pb2.AbortRequest(rid=rid))


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
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model, config.cache_dir))
    router = Router()
    pipeline = Pipeline(DetokenizerManager(tokenizer), router, config)

    server = create_server(config.max_message_mb)
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(DetokenizerService(router, pipeline.on_owner_left), server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    address = f"{config.host}:{config.port}"
    server.add_insecure_port(address)
    await server.start()
    tasks = [asyncio.create_task(pipeline.streams.run()), asyncio.create_task(_report_health(pipeline.streams, health))]
    log.info("detokenizer serving on %s; schedulers %s", address, ", ".join(config.schedulers))

    await stop_requested()
    log.info("stopping")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    config = parse_config(DetokenizerConfig, argv, prog)
    setup_logging(config.log_level, "detokenizer")
    if not config.schedulers:
        raise SystemExit("--schedulers: at least one scheduler address is required")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
