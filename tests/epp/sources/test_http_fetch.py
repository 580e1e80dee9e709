"""The scrape client against real HTTP servers: framing, reuse, failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from epp.sources.http_fetch import FetchError, KeepAliveFetcher
from tests.epp.sources.metrics_server import MetricsServer
from tests.epp.sources.pages import vllm_page


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    running = await MetricsServer().start()
    yield running
    await running.stop()


async def test_reads_the_page_over_one_kept_alive_connection(server: MetricsServer) -> None:
    fetcher = KeepAliveFetcher(server.url)
    for _ in range(5):
        assert await fetcher.get() == (200, server.page)
    assert server.requests == 5
    assert len(server.peers) == 1
    fetcher.close()


@pytest.mark.parametrize(("chunked", "gzip"), [(True, False), (False, True), (True, True)])
async def test_chunked_and_compressed_pages(
    server: MetricsServer, chunked: bool, gzip: bool
) -> None:
    server.chunked, server.gzip = chunked, gzip
    server.page = vllm_page(seed=7)
    fetcher = KeepAliveFetcher(server.url)
    assert await fetcher.get() == (200, server.page)
    assert await fetcher.get() == (200, server.page)
    fetcher.close()


async def test_connection_close_answers_open_a_new_connection(server: MetricsServer) -> None:
    server.close = True
    fetcher = KeepAliveFetcher(server.url)
    for _ in range(3):
        assert (await fetcher.get())[1] == server.page
    assert len(server.peers) == 3
    fetcher.close()


async def test_status_is_returned(server: MetricsServer) -> None:
    server.status = 503
    fetcher = KeepAliveFetcher(server.url)
    status, _ = await fetcher.get()
    assert status == 503
    fetcher.close()


async def test_a_timed_out_request_drops_the_connection(server: MetricsServer) -> None:
    server.delay_s = 0.3
    fetcher = KeepAliveFetcher(server.url)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await fetcher.get()
    server.delay_s = 0.0
    # The late answer to the first request must not be taken for the second's.
    server.page = b"second\n"
    assert await fetcher.get() == (200, b"second\n")
    assert len(server.peers) == 2
    fetcher.close()


async def test_a_server_restart_between_scrapes_is_survived() -> None:
    first = await MetricsServer().start()
    fetcher = KeepAliveFetcher(first.url)
    assert (await fetcher.get())[0] == 200
    await first.stop()
    with pytest.raises(ConnectionRefusedError):
        await fetcher.get()
    # Back on the same port: the old kept-alive connection is gone, a new one works.
    again = await MetricsServer(page=b"back\n").start(first.port)
    try:
        assert await fetcher.get() == (200, b"back\n")
    finally:
        fetcher.close()
        await again.stop()


async def test_garbage_and_oversized_answers_fail(server: MetricsServer) -> None:
    fetcher = KeepAliveFetcher(server.url, max_body_bytes=1000)
    with pytest.raises(FetchError, match="over 1000 bytes"):
        await fetcher.get()
    fetcher.close()

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    raw = await asyncio.start_server(not_http, "127.0.0.1", 0)
    port = raw.sockets[0].getsockname()[1]
    garbage = KeepAliveFetcher(f"http://127.0.0.1:{port}/metrics")
    try:
        with pytest.raises(FetchError, match="not HTTP"):
            await garbage.get()
    finally:
        garbage.close()
        raw.close()
        await raw.wait_closed()


async def test_refused_connection_is_an_os_error() -> None:
    fetcher = KeepAliveFetcher("http://127.0.0.1:1/metrics")
    with pytest.raises(ConnectionRefusedError):
        await fetcher.get()


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="http://"):
        KeepAliveFetcher("https://10.0.0.1:8000/metrics")
