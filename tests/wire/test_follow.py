"""follow_stream: a handler's exception fails that message only; an ended or broken stream is resubscribed."""

import asyncio
from contextlib import asynccontextmanager

import grpc

from services.common.follow import follow_stream


def test_a_failing_handler_fails_its_message_and_the_stream_goes_on():
    handled, failed, subscriptions = [], [], []

    @asynccontextmanager
    async def subscribe():
        subscriptions.append(len(subscriptions))
        if len(subscriptions) == 2:  # the second attempt cannot connect
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

        async def messages():
            for message in (1, 2, 3):
                yield message
        yield messages()

    async def handle(message):
        if message == 2:
            raise ValueError("a bug")
        handled.append(message)

    async def main():
        task = asyncio.create_task(follow_stream("test", subscribe, handle, failed.append, max_backoff_s=0.01))
        while len(subscriptions) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(main())
    assert handled[:4] == [1, 3, 1, 3]  # the message after the failing one, and the next subscription's
    assert failed[:2] == [2, 2]
