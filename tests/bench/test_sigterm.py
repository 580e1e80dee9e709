"""SIGTERM stops a benchmark run as Ctrl-C does, even when it arrives while the event
loop runs a callback that turns every exception into a failed request (aiohttp's
protocol callbacks do): the run must end, not lose one request and go on."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from bench.runner import stop_on_sigterm


@pytest.fixture
def sigterm_handler_restored() -> Iterator[None]:
    """SIGTERM's handler restored after the test, and SIGINT's as a fresh interpreter
    has it during the test: an event loop an earlier test left unclosed in this
    process may still hold SIGINT with a handler that does nothing."""
    before = signal.getsignal(signal.SIGTERM)
    before_int = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)


async def a_run_hit_by_sigterm_in_a_swallowing_callback() -> list[str]:
    swallowed: list[str] = []
    loop = asyncio.get_running_loop()

    def on_data() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except BaseException as exc:  # what aiohttp's data_received does with any error
            swallowed.append(type(exc).__name__)

    loop.call_soon(on_data)
    for _ in range(50):  # the rest of the run
        await asyncio.sleep(0.01)
    return swallowed


@pytest.mark.usefixtures("sigterm_handler_restored")
def test_sigterm_inside_a_callback_ends_the_run_with_keyboard_interrupt() -> None:
    stop_on_sigterm()
    # Without the fix the callback swallows the interrupt and the run ends normally.
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(a_run_hit_by_sigterm_in_a_swallowing_callback())


@pytest.mark.usefixtures("sigterm_handler_restored")
def test_sigterm_outside_an_event_loop_raises_keyboard_interrupt() -> None:
    stop_on_sigterm()
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
