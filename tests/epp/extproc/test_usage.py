"""UsageReader: token usage from JSON bodies and SSE streams, framed across chunks."""

from __future__ import annotations

import json

import pytest

from epp.extproc.usage import MAX_JSON_BODY_BYTES, MAX_SSE_LINE_BYTES, UsageReader
from epp.scheduling.types import Usage

CHAT_USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 7,
    "total_tokens": 127,
    "prompt_tokens_details": {"cached_tokens": 96},
}
EXPECTED = Usage(prompt_tokens=120, completion_tokens=7, cached_tokens=96)


def read(chunks: list[bytes], event_stream: bool) -> Usage | None:
    reader = UsageReader(event_stream=event_stream)
    for chunk in chunks:
        reader.feed(chunk)
    return reader.finish()


def sse(*events: object, newline: bytes = b"\n") -> bytes:
    """An SSE body: one `data:` line per event (dicts as JSON), then [DONE]."""
    out = b""
    for event in events:
        payload = event if isinstance(event, bytes) else json.dumps(event).encode()
        out += b"data: " + payload + newline + newline
    return out + b"data: [DONE]" + newline + newline


def chat_chunk(text: str, usage: object = None) -> dict[str, object]:
    return {
        "id": "cmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}}] if text else [],
        "usage": usage,
    }


STREAM = sse(chat_chunk("Hel"), chat_chunk("lo"), chat_chunk("", CHAT_USAGE))


# ---------------------------------------------------------------------------
# JSON bodies


def test_json_chat_completion_usage() -> None:
    body = json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": CHAT_USAGE,
        }
    ).encode()
    assert read([body], event_stream=False) == EXPECTED


def test_json_usage_without_details() -> None:
    body = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": null}}'
    assert read([body], event_stream=False) == Usage(3, 4, 0)


def test_json_responses_api_usage() -> None:
    body = json.dumps(
        {
            "id": "resp_1",
            "object": "response",
            "output": [],
            "usage": {
                "input_tokens": 50,
                "output_tokens": 9,
                "total_tokens": 59,
                "input_tokens_details": {"cached_tokens": 32},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }
    ).encode()
    assert read([body], event_stream=False) == Usage(50, 9, 32)


def test_json_body_split_across_chunks() -> None:
    body = json.dumps({"choices": [], "usage": CHAT_USAGE}).encode()
    chunks = [body[i : i + 7] for i in range(0, len(body), 7)]
    assert len(chunks) > 3
    assert read(chunks, event_stream=False) == EXPECTED


def test_json_body_read_only_at_the_end() -> None:
    reader = UsageReader(event_stream=False)
    body = json.dumps({"usage": CHAT_USAGE}).encode()
    reader.feed(body)
    assert reader.usage is None
    assert reader.finish() == EXPECTED
    assert reader.usage == EXPECTED


def test_json_body_without_usage() -> None:
    assert read([b'{"choices": []}'], event_stream=False) is None
    assert read([b'{"usage": null}'], event_stream=False) is None


def test_json_body_over_the_bound_is_ignored() -> None:
    usage = json.dumps({"usage": CHAT_USAGE}).encode()
    padding = b" " * (MAX_JSON_BODY_BYTES - len(usage) + 1)
    body = usage[:-1] + padding + b"}"
    assert len(body) == MAX_JSON_BODY_BYTES + 1
    chunks = [body[i : i + 1_000_000] for i in range(0, len(body), 1_000_000)]
    reader = UsageReader(event_stream=False)
    for chunk in chunks:
        reader.feed(chunk)
    assert len(reader._pending) == 0  # the memory is let go
    assert reader.finish() is None


def test_json_body_at_the_bound_is_read() -> None:
    usage = json.dumps({"usage": CHAT_USAGE}).encode()
    body = usage[:-1] + b" " * (MAX_JSON_BODY_BYTES - len(usage)) + b"}"
    assert len(body) == MAX_JSON_BODY_BYTES
    assert read([body[:100], body[100:]], event_stream=False) == EXPECTED


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"\xff\xfe\x00",
        b"[1, 2, 3]",
        b'{"usage": "lots"}',
        b'{"usage": {"prompt_tokens": "many"}}',
        b'{"usage": {"prompt_tokens": 1',
        b'{"response": 5}',
    ],
)
def test_json_garbage_yields_none(body: bytes) -> None:
    assert read([body], event_stream=False) is None


# ---------------------------------------------------------------------------
# Server-sent events


def test_sse_usage_in_the_last_data_line_before_done() -> None:
    assert read([STREAM], event_stream=True) == EXPECTED


def test_sse_usage_is_read_as_the_lines_complete() -> None:
    reader = UsageReader(event_stream=True)
    head, tail = STREAM.split(b"[DONE]")
    reader.feed(head)
    assert reader.usage == EXPECTED  # before the stream ends
    reader.feed(b"[DONE]" + tail)
    assert reader.finish() == EXPECTED


def test_sse_last_usage_wins() -> None:
    first = {"prompt_tokens": 1, "completion_tokens": 1}
    body = sse(chat_chunk("a", first), chat_chunk("", CHAT_USAGE))
    assert read([body], event_stream=True) == EXPECTED


def test_sse_null_usage_keeps_the_last_one() -> None:
    body = sse(chat_chunk("", CHAT_USAGE), chat_chunk("late", None))
    assert read([body], event_stream=True) == EXPECTED


def test_sse_without_usage() -> None:
    assert read([sse(chat_chunk("a"), chat_chunk("b"))], event_stream=True) is None


def test_sse_responses_completed_event() -> None:
    body = (
        b"event: response.created\n"
        b'data: {"type":"response.created","response":{"id":"resp_1","usage":null}}\n\n'
        b"event: response.output_text.delta\n"
        b'data: {"type":"response.output_text.delta","delta":"Hi"}\n\n'
        b"event: response.completed\n"
        b'data: {"type":"response.completed","response":{"id":"resp_1","status":"completed",'
        b'"usage":{"input_tokens":40,"output_tokens":2,'
        b'"input_tokens_details":{"cached_tokens":16}}}}\n\n'
    )
    assert read([body], event_stream=True) == Usage(40, 2, 16)


def test_sse_data_line_without_space() -> None:
    body = b'data:{"usage":{"prompt_tokens":5,"completion_tokens":6}}\n\ndata:[DONE]\n\n'
    assert read([body], event_stream=True) == Usage(5, 6, 0)


def test_sse_usage_mentioned_outside_a_data_line_is_ignored() -> None:
    body = b'event: x\n: comment "usage"\nid: "usage"\n\n'
    assert read([body], event_stream=True) is None


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_sse_split_at_every_byte_offset(newline: bytes) -> None:
    body = sse(chat_chunk("Hel"), chat_chunk("", CHAT_USAGE), newline=newline)
    for offset in range(len(body) + 1):
        assert read([body[:offset], body[offset:]], event_stream=True) == EXPECTED, offset


def test_sse_split_in_three_around_the_usage_line() -> None:
    body = STREAM
    start = body.index(b'"usage": {')
    end = body.index(b"data: [DONE]")
    for first in range(start - 20, start + 20):
        for second in range(end - 10, end + 3):
            chunks = [body[:first], body[first:second], body[second:]]
            assert read(chunks, event_stream=True) == EXPECTED, (first, second)


def test_sse_crlf_line_endings() -> None:
    body = sse(chat_chunk("x"), chat_chunk("", CHAT_USAGE), newline=b"\r\n")
    assert b"\r\n" in body
    assert read([body], event_stream=True) == EXPECTED


def test_sse_one_byte_chunks() -> None:
    chunks = [STREAM[i : i + 1] for i in range(len(STREAM))]
    assert read(chunks, event_stream=True) == EXPECTED


def test_sse_empty_chunks_are_harmless() -> None:
    middle = len(STREAM) // 2
    chunks = [b"", STREAM[:middle], b"", b"", STREAM[middle:], b""]
    assert read(chunks, event_stream=True) == EXPECTED


def test_sse_last_line_without_newline_is_read_at_the_end() -> None:
    body = b'data: {"usage": {"prompt_tokens": 9, "completion_tokens": 1}}'
    reader = UsageReader(event_stream=True)
    reader.feed(body)
    assert reader.usage is None
    assert reader.finish() == Usage(9, 1, 0)


def test_sse_over_long_line_is_skipped_and_framing_resumes() -> None:
    # A data line longer than the bound, fed in pieces, then a usage line: the long
    # line is dropped, and the next line is still framed correctly.
    long_line = b'data: {"usage": {"prompt_tokens": 999}, "pad": "' + b"x" * (
        MAX_SSE_LINE_BYTES + 100
    )
    body = long_line + b'"}\n\n' + sse(chat_chunk("", CHAT_USAGE))
    piece = 64 * 1024
    chunks = [body[i : i + piece] for i in range(0, len(body), piece)]
    reader = UsageReader(event_stream=True)
    for chunk in chunks:
        reader.feed(chunk)
        assert len(reader._pending) <= MAX_SSE_LINE_BYTES
    assert reader.finish() == EXPECTED


def test_sse_over_long_line_ending_at_a_chunk_boundary() -> None:
    long_line = b"data: " + b"y" * (MAX_SSE_LINE_BYTES + 1)
    usage_line = sse(chat_chunk("", CHAT_USAGE))
    assert read([long_line, b"\n", usage_line], event_stream=True) == EXPECTED
    assert read([long_line, b"\n" + usage_line], event_stream=True) == EXPECTED


def test_sse_over_long_unterminated_line_at_the_end_is_dropped() -> None:
    first = sse(chat_chunk("", CHAT_USAGE))[: -len(b"data: [DONE]\n\n")]
    long_tail = b'data: {"usage": {"prompt_tokens": 1}, "x": "' + b"z" * MAX_SSE_LINE_BYTES
    assert read([first, long_tail], event_stream=True) == EXPECTED


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe\n\n",
        b'data: {"usage": 5}\n\n',
        b'data: {"usage": {"prompt_tokens": "x"}}\n\n',
        b'data: {"usage": {\n\n',
        b"data: [DONE]\n\n",
        b'{"usage": {"prompt_tokens": 1}}',  # a JSON body is not an event stream
    ],
)
def test_sse_garbage_yields_none(body: bytes) -> None:
    assert read([body], event_stream=True) is None
