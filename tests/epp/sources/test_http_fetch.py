"""The scrape client against real HTTP servers: framing, reuse, failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from epp.sources.http_fetch import DEFAULT_MAX_BODY_BYTES, FetchError, KeepAliveFetcher
from tests.epp.sources.metrics_server import MetricsServer
from tests.epp.sources.pages import vllm_page


class Fetcher:
    """A `KeepAliveFetcher` whose requests are awaited: `get()` is (status, body) or
    raises the error its callback received; a cancelled `get()` aborts."""

    def __init__(self, url: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.fetcher = KeepAliveFetcher(url, self._answer, self._error, max_body_bytes)
        self.outcome: asyncio.Future[tuple[int, bytes]] | None = None
        self.callbacks = 0

    def _answer(self, status: int, body: bytes) -> None:
        self.callbacks += 1
        assert self.outcome is not None
        self.outcome.set_result((status, body))

    def _error(self, exc: Exception) -> None:
        self.callbacks += 1
        assert self.outcome is not None
        self.outcome.set_exception(exc)

    async def get(self) -> tuple[int, bytes]:
        self.outcome = asyncio.get_running_loop().create_future()
        self.fetcher.request()
        try:
            return await self.outcome
        except asyncio.CancelledError:
            self.fetcher.abort()
            raise

    def abort(self) -> None:
        self.fetcher.abort()


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    running = await MetricsServer().start()
    yield running
    await running.stop()


async def test_reads_the_page_over_one_kept_alive_connection(server: MetricsServer) -> None:
    fetcher = Fetcher(server.url)
    for _ in range(5):
        assert await fetcher.get() == (200, server.page)
    assert server.requests == 5
    assert len(server.peers) == 1
    fetcher.abort()


@pytest.mark.parametrize(("chunked", "gzip"), [(True, False), (False, True), (True, True)])
async def test_chunked_and_compressed_pages(
    server: MetricsServer, chunked: bool, gzip: bool
) -> None:
    server.chunked, server.gzip = chunked, gzip
    server.page = vllm_page(seed=7)
    fetcher = Fetcher(server.url)
    assert await fetcher.get() == (200, server.page)
    assert await fetcher.get() == (200, server.page)
    fetcher.abort()


async def test_connection_close_answers_open_a_new_connection(server: MetricsServer) -> None:
    server.close = True
    fetcher = Fetcher(server.url)
    for _ in range(3):
        assert (await fetcher.get())[1] == server.page
    assert len(server.peers) == 3
    fetcher.abort()


async def test_status_is_returned(server: MetricsServer) -> None:
    server.status = 503
    fetcher = Fetcher(server.url)
    status, _ = await fetcher.get()
    assert status == 503
    fetcher.abort()


async def test_a_timed_out_request_drops_the_connection(server: MetricsServer) -> None:
    server.delay_s = 0.3
    fetcher = Fetcher(server.url)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await fetcher.get()
    server.delay_s = 0.0
    # The late answer to the first request must not be taken for the second's.
    server.page = b"second\n"
    assert await fetcher.get() == (200, b"second\n")
    assert len(server.peers) == 2
    fetcher.abort()


async def test_a_server_restart_between_scrapes_is_survived() -> None:
    first = await MetricsServer().start()
    fetcher = Fetcher(first.url)
    assert (await fetcher.get())[0] == 200
    await first.stop()
    with pytest.raises(ConnectionRefusedError):
        await fetcher.get()
    # Back on the same port: the old kept-alive connection is gone, a new one works.
    again = await MetricsServer(page=b"back\n").start(first.port)
    try:
        assert await fetcher.get() == (200, b"back\n")
    finally:
        fetcher.abort()
        await again.stop()


async def test_garbage_and_oversized_answers_fail(server: MetricsServer) -> None:
    fetcher = Fetcher(server.url, max_body_bytes=1000)
    with pytest.raises(FetchError, match="over 1000 bytes"):
        await fetcher.get()
    fetcher.abort()

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    raw = await asyncio.start_server(not_http, "127.0.0.1", 0)
    port = raw.sockets[0].getsockname()[1]
    garbage = Fetcher(f"http://127.0.0.1:{port}/metrics")
    try:
        with pytest.raises(FetchError, match="not HTTP"):
            await garbage.get()
    finally:
        garbage.abort()
        raw.close()
        await raw.wait_closed()


async def test_refused_connection_is_an_os_error() -> None:
    fetcher = Fetcher("http://127.0.0.1:1/metrics")
    with pytest.raises(ConnectionRefusedError):
        await fetcher.get()


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="http://"):
        Fetcher("https://10.0.0.1:8000/metrics")


async def test_one_request_at_a_time(server: MetricsServer) -> None:
    fetcher = Fetcher(server.url)
    first = asyncio.ensure_future(fetcher.get())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="outstanding"):
        fetcher.fetcher.request()
    assert (await first)[0] == 200
    fetcher.abort()


async def test_an_aborted_request_never_calls_back(server: MetricsServer) -> None:
    server.delay_s = 0.1
    fetcher = Fetcher(server.url)
    fetcher.outcome = asyncio.get_running_loop().create_future()
    fetcher.fetcher.request()
    await asyncio.sleep(0.02)
    fetcher.fetcher.abort()
    assert not fetcher.fetcher.busy
    await asyncio.sleep(0.2)  # the answer comes, to a closed connection
    assert fetcher.callbacks == 0
    # And aborting while still connecting: the connection made is dropped.
    fetcher.fetcher.request()
    fetcher.fetcher.abort()
    await asyncio.sleep(0.05)
    assert fetcher.callbacks == 0
    server.delay_s = 0.0
    assert (await fetcher.get())[0] == 200
    assert fetcher.callbacks == 1
    fetcher.abort()
