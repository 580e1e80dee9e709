"""A minimal HTTP/1.1 GET client for scraping one `http://` URL many times a second.

The metrics source GETs every model server's /metrics 20 times a second: at 128 pods
that is 2,560 requests a second, and a general client's per-request machinery
(aiohttp's: request and response objects, header multidicts, cookie and redirect
handling, its connector's pool bookkeeping) made a scrape cost about 3 times as
much CPU as with this client (docs/performance.md). This client does only what a
scrape needs: one kept-alive connection per URL, a request written as prebuilt
bytes, and a response read into a reused buffer by a small protocol that knows
`Content-Length`, chunked bodies, gzip/deflate and read-until-close. Anything else
(TLS, proxies, redirects) is left to the aiohttp path of the metrics source.

One `KeepAliveFetcher` serves one URL and runs one request at a time. It is driven
by callbacks, not awaited: `request()` writes the request and returns, and the
answer (or the error) is handed to the fetcher's callbacks from the event loop's
read callback. Awaiting each scrape cost a future, a task wakeup and a timer per
request, about a fifth of a scrape's CPU at 2,560 scrapes a second; the caller
keeps the time instead (`abort()`). A request that is aborted or fails closes the
connection (a late answer must not be read as the next one), and the next request
opens a new one.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

MAX_HEADER_BYTES: Final = 64 * 1024
DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024


class FetchError(Exception):
    """The server's answer is not a usable HTTP response."""


class ClosedBeforeAnswer(ConnectionError):
    """The server closed the connection without a byte of answer."""


# Each connection reads into its own buffer (asyncio's BufferedProtocol), reused
# scrape after scrape. A plain Protocol gets every read as a new bytes object,
# which the socket layer allocates at 256 KB (above the C allocator's mmap
# threshold) and shrinks: a map, page faults and an unmap per scrape, which
# measured as much as the rest of the scrape.
INITIAL_BUFFER_BYTES: Final = 64 * 1024
MIN_FREE_BYTES: Final = 16 * 1024


class _Response(asyncio.BufferedProtocol):
    """Reads responses off one connection; one outstanding request at a time, whose
    outcome goes to `owner` (None: nobody is waiting for an answer)."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.owner: KeepAliveFetcher | None = None
        self.buffer = bytearray(INITIAL_BUFFER_BYTES)
        self.filled = 0  # bytes of the current response in `buffer`
        self._reset()

    def _reset(self) -> None:
        if self.filled == 0 and len(self.buffer) > 16 * INITIAL_BUFFER_BYTES:
            self.buffer = bytearray(INITIAL_BUFFER_BYTES)  # after a huge page
        self.status = 0
        self.header_end = -1
        self.length = -1  # Content-Length; -1: chunked or until close
        self.chunked = False
        self.keep_alive = True
        self.encoding = b""
        self.chunks: list[bytes] | None = None  # a chunked body's pieces
        self.chunk_pos = 0
        self.chunk_bytes = 0
        self.received = 0

    def expect(self, owner: KeepAliveFetcher) -> None:
        self._reset()
        self.owner = owner

    # -- asyncio.BufferedProtocol ----------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self.buffer) - self.filled < MIN_FREE_BYTES:
            # Grow into a new buffer: the transport may still hold a view of the
            # old one, and a bytearray with views cannot be resized.
            grown = bytearray(max(2 * len(self.buffer), self.filled + MIN_FREE_BYTES))
            grown[: self.filled] = memoryview(self.buffer)[: self.filled]
            self.buffer = grown
        return memoryview(self.buffer)[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.owner is None:
            # Bytes nobody asked for: the connection is out of step; drop it.
            self._close()
            return
        self.filled += nbytes
        self.received += nbytes
        try:
            self._parse()
        except FetchError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.owner is None:
            return
        if self.header_end >= 0 and self.length < 0 and not self.chunked:
            # No length given: the body is everything up to the close.
            self._finish(self._slice(self.header_end, self.filled), self.filled)
            return
        if self.received:
            self._fail(ConnectionError("the server closed the connection mid-response"))
        else:
            self._fail(ClosedBeforeAnswer("the server closed the connection before answering"))

    # -- parsing ---------------------------------------------------------------

    def _parse(self) -> None:
        if self.header_end < 0:
            end = self.buffer.find(b"\r\n\r\n", 0, self.filled)
            if end < 0:
                if self.filled > MAX_HEADER_BYTES:
                    raise FetchError("the response headers are over 64 KiB")
                return
            self._read_head(self._slice(0, end))
            self.header_end = end + 4
        if self.chunked:
            self._read_chunks()
            return
        body_bytes = self.filled - self.header_end
        if body_bytes > self.max_body_bytes:
            raise FetchError(f"the page is over {self.max_body_bytes} bytes")
        if self.length >= 0 and body_bytes >= self.length:
            start = self.header_end
            self._finish(self._slice(start, start + self.length), start + self.length)

    def _slice(self, start: int, end: int) -> bytes:
        return bytes(memoryview(self.buffer)[start:end])

    def _read_head(self, head: bytes) -> None:
        line_end = head.find(b"\r\n")
        parts = (head if line_end < 0 else head[:line_end]).split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise FetchError("the answer is not HTTP/1.x")
        self.status = int(parts[1])
        if parts[0] == b"HTTP/1.0":
            self.keep_alive = False
        if line_end < 0:
            return
        # The four fields that matter, found in the lowered header block (a loop
        # over every line cost as much as the rest of the response's handling).
        fields = head[line_end:].lower() + b"\r\n"
        length = _field(fields, b"\r\ncontent-length:")
        if length is not None:
            if not length.isdigit():
                raise FetchError(f"bad Content-Length {length!r}")
            self.length = int(length)
        encoding = _field(fields, b"\r\ntransfer-encoding:")
        if encoding is not None:
            self.chunked = b"chunked" in encoding
        connection = _field(fields, b"\r\nconnection:")
        if connection == b"close":
            self.keep_alive = False
        elif connection == b"keep-alive":
            self.keep_alive = True
        self.encoding = _field(fields, b"\r\ncontent-encoding:") or b""
        if self.length > self.max_body_bytes:
            raise FetchError(f"the page is over {self.max_body_bytes} bytes")

    def _read_chunks(self) -> None:
        buffer, filled = self.buffer, self.filled
        pos = max(self.chunk_pos, self.header_end)
        while True:
            line_end = buffer.find(b"\r\n", pos, filled)
            if line_end < 0:
                break
            size_text = bytes(buffer[pos:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise FetchError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                # The last chunk; no trailers are expected from a metrics page, but
                # read up to the blank line that ends them so the connection stays
                # in step.
                trailer_end = buffer.find(b"\r\n", line_end + 2, filled)
                if trailer_end < 0:
                    break
                self._finish(b"".join(self.chunks or ()), trailer_end + 2)
                return
            data_end = line_end + 2 + size
            if filled < data_end + 2:
                break
            self.chunk_bytes += size
            if self.chunk_bytes > self.max_body_bytes:
                raise FetchError(f"the page is over {self.max_body_bytes} bytes")
            if self.chunks is None:
                self.chunks = []
            self.chunks.append(self._slice(line_end + 2, data_end))
            pos = data_end + 2
        self.chunk_pos = pos

    # -- outcomes ----------------------------------------------------------------

    def _finish(self, body: bytes, response_end: int) -> None:
        owner = self.owner
        self.owner = None
        if self.filled > response_end:
            # More than one answer to one request: out of step, do not reuse.
            self.keep_alive = False
        self.filled = 0
        if not self.keep_alive:
            self._close()
        if owner is None:
            return
        try:
            body = _decode(body, self.encoding)
        except FetchError as exc:
            owner._failed(self, exc)
            return
        owner._answered(self, self.status, body)

    def _fail(self, exc: Exception) -> None:
        owner = self.owner
        self.owner = None
        self.filled = 0
        self._close()
        if owner is not None:
            owner._failed(self, exc)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def _field(fields: bytes, name: bytes) -> bytes | None:
    """A header field's value (lowered) from `fields`, the lowered header lines,
    each after a CRLF and ending with one; `name` is CRLF, the name and a colon."""
    at = fields.find(name)
    if at < 0:
        return None
    start = at + len(name)
    return fields[start : fields.find(b"\r\n", start)].strip()


def _decode(body: bytes, encoding: bytes) -> bytes:
    # The request asks for `identity`, but a server may compress anyway.
    if not encoding or encoding == b"identity":
        return body
    try:
        if encoding in (b"gzip", b"x-gzip"):
            return zlib.decompress(body, 16 + zlib.MAX_WBITS)
        if encoding == b"deflate":
            return zlib.decompress(body)
    except zlib.error as exc:
        raise FetchError(f"the {encoding.decode()} body does not decompress: {exc}") from None
    raise FetchError(f"unsupported Content-Encoding {encoding.decode(errors='replace')!r}")


OnAnswer = Callable[[int, bytes], None]
OnError = Callable[[Exception], None]


class KeepAliveFetcher:
    """GETs one `http://` URL over a kept-alive connection, one request at a time.

    `request()` starts a GET and returns at once; `on_answer(status, body)` or
    `on_error(exc)` is called when it ends (OSError: connect, reset; FetchError:
    not a usable answer), from an event-loop callback. The caller bounds the time:
    `abort()` drops the outstanding request (no callback) and its connection."""

    def __init__(
        self,
        url: str,
        on_answer: OnAnswer,
        on_error: OnError,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// URL")
        self.host = parts.hostname
        self.port = parts.port or 80
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: text/plain\r\n"
            "Accept-Encoding: identity\r\nUser-Agent: epp-metrics\r\n\r\n"
        ).encode("latin-1")
        self.max_body_bytes = max_body_bytes
        self._on_answer = on_answer
        self._on_error = on_error
        self._protocol: _Response | None = None
        self._connecting: asyncio.Task[None] | None = None
        self.busy = False  # a request is outstanding
        self._reused = False  # ... on a connection that served an earlier one

    def request(self) -> None:
        """Start a GET; its outcome goes to the callbacks. Must run in the event
        loop, with no request outstanding."""
        if self.busy:
            raise RuntimeError("a request is already outstanding")
        self.busy = True
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None and not protocol.closed:
            self._reused = True
            self._send(protocol)
        else:
            self._connect()

    def abort(self) -> None:
        """Drop the outstanding request, if any, and the connection: whatever comes
        later on it would be read as the answer to the next request."""
        self.busy = False
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self._protocol is not None:
            self._protocol.owner = None
            self._protocol._close()
            self._protocol = None

    def _connect(self) -> None:
        self._reused = False
        self._connecting = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        max_body = self.max_body_bytes
        try:
            _, protocol = await loop.create_connection(
                lambda: _Response(max_body), self.host, self.port
            )
        except OSError as exc:
            self._connecting = None
            self.busy = False
            self._on_error(exc)
            return
        self._connecting = None
        if not self.busy:  # aborted while connecting
            protocol._close()
            return
        self._protocol = protocol
        self._send(protocol)

    def _send(self, protocol: _Response) -> None:
        protocol.expect(self)
        assert protocol.transport is not None
        protocol.transport.write(self._request)

    # Called by the protocol.

    def _answered(self, protocol: _Response, status: int, body: bytes) -> None:
        if protocol is not self._protocol or not self.busy:
            return
        self.busy = False
        self._on_answer(status, body)

    def _failed(self, protocol: _Response, exc: Exception) -> None:
        if protocol is not self._protocol or not self.busy:
            return
        self._protocol = None
        protocol._close()
        if isinstance(exc, ClosedBeforeAnswer) and self._reused:
            # A kept-alive connection the server closed while idle fails on its
            # first use without a byte of answer: that is not the server failing,
            # so try once more on a new connection.
            self._connect()
            return
        self.busy = False
        self._on_error(exc)
