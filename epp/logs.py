"""Structured logging: JSON or text lines, each with the request id of the request
being handled (propagated from the client's `x-request-id`).

Verbosity follows GIE's `-v` levels: 1 warnings, 2 (default) info, 3 one line per
routed request, 4 and up debug. Prompts never appear in logs unless
`--log-prompts` is given.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Final

from epp import defaults

VERBOSE: Final = 15  # between DEBUG and INFO: one line per request
logging.addLevelName(VERBOSE, "VERBOSE")

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)

_STANDARD_ATTRS: Final = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


def level_for_verbosity(verbosity: int) -> int:
    if verbosity <= 1:
        return logging.WARNING
    if verbosity == 2:
        return logging.INFO
    if verbosity == 3:
        return VERBOSE
    return logging.DEBUG


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if getattr(record, "request_id", None):
            entry["request_id"] = record.request_id  # type: ignore[attr-defined]
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key != "request_id":
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        extras = " ".join(
            f"{k}={v}"
            for k, v in vars(record).items()
            if k not in _STANDARD_ATTRS and k != "request_id"
        )
        line = (
            f"{self.formatTime(record, '%H:%M:%S')}.{int(record.msecs):03d}"
            f" {record.levelname:<7} {record.name}: {record.getMessage()}"
        )
        if request_id:
            line += f" request_id={request_id}"
        if extras:
            line += f" {extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(
    log_format: str = defaults.LOG_FORMAT, verbosity: int = defaults.LOG_VERBOSITY
) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_for_verbosity(verbosity))
    # Library chatter stays at warnings unless debugging.
    if verbosity < 5:
        for name in ("aiohttp.access", "asyncio", "grpc"):
            logging.getLogger(name).setLevel(logging.WARNING)


class LogOnce:
    """Logs a message the first time its cause is seen, and only counts it after:
    bad input that repeats (a misconfigured engine, a garbage publisher) must not
    flood the logs. Causes are bounded by the caller (a reason and an endpoint)."""

    def __init__(self, logger: logging.Logger, max_causes: int = 10_000) -> None:
        self.logger = logger
        self.max_causes = max_causes
        self._seen: set[object] = set()

    def __call__(self, cause: object, level: int, message: str, *args: object) -> bool:
        """Log `message` unless `cause` was logged before; True if it was logged."""
        if cause in self._seen:
            return False
        if len(self._seen) >= self.max_causes:
            self._seen.clear()
        self._seen.add(cause)
        self.logger.log(level, message, *args)
        return True

    def forget(self, cause: object) -> None:
        """Let `cause` be logged again (it was fixed, say)."""
        self._seen.discard(cause)
