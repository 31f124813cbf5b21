"""A gateway-detokenizer stream cut while both processes stay up.

A second gateway on the session's scheduler and detokenizer reaches the detokenizer through a TCP proxy that the
test can cut. Messages in transit on the cut connection are gone and nothing replays them (the detokenizer did
not restart), so the requests in flight must fail explicitly (503 naming the cut) when the gateway reconnects:
never a short 200, never a hang. New requests work afterwards.
"""

import asyncio
import concurrent.futures
import threading
import time

import httpx

from harness.procs import free_port
from harness.stack import another_gateway

REQUEST = {"text": "a long one", "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}


class CuttableProxy:
    """Forwards 127.0.0.1:port to a target; cut() closes every connection it carries."""

    def __init__(self, port: int, target_port: int):
        self.port, self.target_port = port, target_port
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", self.port)

    async def _connect(self, reader, writer) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, upstream_writer}
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer),
                             return_exceptions=True)

    def cut(self) -> None:
        async def close_all():
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()
        asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(timeout=10)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self.cut()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()


def test_a_cut_output_stream_fails_its_requests_explicitly(stack):
    proxy_port = free_port()  # the second gateway's detokenizer address: the proxy, in front of the real one
    proxy = CuttableProxy(proxy_port, stack.services["detokenizer"].port)
    try:
        with another_gateway(stack, "--detokenizers", f"127.0.0.1:{proxy_port}") as http:
            url = f"{str(http.base_url).rstrip('/')}/generate"
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(httpx.post, url, json=REQUEST, timeout=120) for _ in range(4)]
                time.sleep(3)  # the requests are generating
                cut = time.monotonic()
                proxy.cut()
                replies = [future.result() for future in futures]
            ended = time.monotonic()

            for reply in replies:
                assert reply.status_code == 503, reply.text[:300]  # never a short 200
                assert "was cut" in reply.json()["error"]["message"], reply.text
            assert ended - cut < 10, "the requests did not fail promptly"
            deadline = time.monotonic() + 30
            while (reply := httpx.post(url, json={"text": "after", "sampling_params": {"max_new_tokens": 4}},
                                       timeout=60)).status_code != 200:
                assert time.monotonic() < deadline, reply.text
                time.sleep(0.5)
            assert reply.json()["meta_info"]["completion_tokens"] == 4
    finally:
        proxy.close()
