"""Token usage read from a response body as it streams by.

Two shapes: a JSON body (`usage` at the top level, or `response.usage` for the
Responses API), read once the body has ended; or Server-Sent Events, where usage
arrives in a `data:` line, usually the last before `data: [DONE]`. SSE lines are
framed across chunks: a line split over two body chunks is joined, never lost.
The body itself is never changed.
"""

from __future__ import annotations

from typing import Final

import msgspec

from epp.scheduling.types import Usage

# Bounds that keep a huge or malformed response from costing memory: past them
# usage is simply not read.
MAX_JSON_BODY_BYTES: Final = 8 * 1024 * 1024
MAX_SSE_LINE_BYTES: Final = 1024 * 1024


class _TokenDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _WireUsage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _TokenDetails | None = None
    # Responses API names
    input_tokens: int | None = None
    output_tokens: int | None = None
    input_tokens_details: _TokenDetails | None = None

    def to_usage(self) -> Usage:
        details = self.prompt_tokens_details or self.input_tokens_details
        return Usage(
            prompt_tokens=self.prompt_tokens or self.input_tokens or 0,
            completion_tokens=self.completion_tokens or self.output_tokens or 0,
            cached_tokens=(details.cached_tokens or 0) if details else 0,
        )


class _ResponseObject(msgspec.Struct):
    usage: _WireUsage | None = None


class _Document(msgspec.Struct):
    usage: _WireUsage | None = None
    response: _ResponseObject | None = None  # Responses API `response.completed` event

    def wire_usage(self) -> _WireUsage | None:
        if self.usage is not None:
            return self.usage
        return self.response.usage if self.response is not None else None


_decoder: Final = msgspec.json.Decoder(_Document)


def _usage_of(payload: bytes) -> Usage | None:
    try:
        wire = _decoder.decode(payload).wire_usage()
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return None
    return wire.to_usage() if wire is not None else None


class UsageReader:
    """Fed the response body chunk by chunk; `usage` is the last usage seen."""

    def __init__(self, event_stream: bool) -> None:
        self.event_stream = event_stream
        self.usage: Usage | None = None
        self._pending = bytearray()  # SSE: the unfinished last line; JSON: the body
        self._overflow = False  # JSON body over its bound: usage is not read
        self._skipping = False  # SSE: inside a line over its bound, dropped

    def feed(self, chunk: bytes) -> None:
        if self._overflow or not chunk:
            return
        if not self.event_stream:
            if len(self._pending) + len(chunk) > MAX_JSON_BODY_BYTES:
                self._overflow = True
                self._pending.clear()
            else:
                self._pending += chunk
            return
        start = 0
        newline = chunk.find(b"\n")
        while newline != -1:
            if self._skipping:
                self._skipping = False  # the end of an over-long line: resume
            elif self._pending:
                self._pending += chunk[start:newline]
                self._line(bytes(self._pending))
                self._pending.clear()
            else:
                self._line(chunk[start:newline])
            start = newline + 1
            newline = chunk.find(b"\n", start)
        rest = len(chunk) - start
        if rest and not self._skipping:
            if len(self._pending) + rest > MAX_SSE_LINE_BYTES:
                self._pending.clear()
                self._skipping = True
            else:
                self._pending += chunk[start:]

    def _line(self, line: bytes) -> None:
        # Only a `data:` line that mentions usage is worth decoding.
        if line.startswith(b"data:") and b'"usage"' in line:
            usage = _usage_of(line[5:].strip())
            if usage is not None:
                self.usage = usage

    def finish(self) -> Usage | None:
        """The body has ended: read what is left."""
        if self._pending and not self._overflow and not self._skipping:
            if self.event_stream:
                self._line(bytes(self._pending))
            else:
                self.usage = _usage_of(bytes(self._pending)) or self.usage
        self._pending.clear()
        return self.usage
