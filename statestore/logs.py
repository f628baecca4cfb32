"""Logging: JSON lines on stderr for machines, a plain format for a person at a terminal.

One handler on the root logger serves our loggers and uvicorn's alike. uvicorn's access log is switched
off (`access_log=False`) because the request middleware writes a better one: route template, request
id, duration to the last byte.

Exception messages are not logged unless the exception type is known to carry no request data (see
`_MESSAGE_SAFE`): a pydantic ValidationError quotes its input, a SQLAlchemy error its bound parameters,
and either can be a user's message content. The type and the stack frames are always logged.
"""

from __future__ import annotations

import logging
import logging.config
import time
import traceback
from contextvars import ContextVar
from typing import Any

import orjson

from statestore.base62 import random_key
from statestore.errors import StatestoreError, StreamBrokenOff

request_id_var: ContextVar[str | None] = ContextVar("statestore_request_id", default=None)

_REQUEST_ID_CHARS = 24

# Our own error messages are written to be shown to clients; OS errors name hosts and errno, not payloads.
_MESSAGE_SAFE: tuple[type[BaseException], ...] = (StatestoreError, OSError)
_WITHHELD = "<message withheld>"

# Attributes every LogRecord has; anything else on a record came from `extra={...}`.
_RECORD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime", "taskName", "request_id"}
)
# uvicorn passes an ANSI-coloured duplicate of its message as an extra.
_DROPPED_EXTRAS = frozenset({"color_message"})

_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
# httpx logs every backend request's full URL, query included, at INFO; our access log already covers it.
# Alembic narrates every step at INFO, including the startup schema check.
_QUIETED_LOGGERS = ("httpx", "httpcore", "aiohttp", "alembic")


def new_request_id() -> str:
    return "req_" + random_key(_REQUEST_ID_CHARS)


_second: tuple[int, str] = (-1, "")  # the last second formatted: every access line of that second reuses it


def _timestamp(created: float) -> str:
    global _second  # noqa: PLW0603 - one tuple, replaced whole, so a thread that logs too never sees half of it
    second = int(created)
    cached = _second
    if cached[0] != second:
        cached = _second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{cached[1]}.{int(created * 1000) % 1000:03d}Z"


def _exception_message(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, _MESSAGE_SAFE) else _WITHHELD


def _format_exception(exc: BaseException) -> str:
    """Like traceback.format_exception, chains included, but with messages filtered by `_MESSAGE_SAFE`."""
    chain: list[tuple[BaseException, str | None]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    link: str | None = None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, "The above exception was the direct cause of the following exception:"
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, "During handling of the above exception, another exception occurred:"
        else:
            current = None
    parts: list[str] = []
    for item, joined_by in reversed(chain):
        if item.__traceback__ is not None:
            parts.append("Traceback (most recent call last):\n")
            parts.extend(traceback.format_tb(item.__traceback__))
        parts.append(f"{_qualified_name(type(item))}: {_exception_message(item)}\n")
        if joined_by is not None:
            parts.append(f"\n{joined_by}\n\n")
    return "".join(parts).rstrip("\n")


def _qualified_name(cls: type[BaseException]) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _exc_info(record: logging.LogRecord) -> BaseException | None:
    info = record.exc_info
    if not info:
        return None
    exc = info[1]
    return exc if isinstance(exc, BaseException) else None


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS and k not in _DROPPED_EXTRAS}


def _request_id(record: logging.LogRecord) -> str | None:
    explicit = getattr(record, "request_id", None)
    return explicit if isinstance(explicit, str) else request_id_var.get()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, extras, exception."""

    def __init__(self, use_colors: bool | None = None) -> None:
        # `use_colors` is accepted because uvicorn sets it on the formatters of a dict config it is given.
        super().__init__()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            # uvicorn ends some messages with a newline.
            "msg": record.getMessage().rstrip("\n"),
        }
        request_id = _request_id(record)
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in _extras(record).items():
            entry.setdefault(key, value)
        exc = _exc_info(record)
        if exc is not None:
            entry["exc_type"] = _qualified_name(type(exc))
            entry["exc"] = _exception_message(exc)
            entry["traceback"] = _format_exception(exc)
        if record.stack_info:
            entry["stack"] = record.stack_info
        return orjson.dumps(entry, default=repr, option=orjson.OPT_NON_STR_KEYS).decode()


class PlainFormatter(logging.Formatter):
    """`ts LEVEL logger [request id] msg key=value …`, then the filtered traceback."""

    def __init__(self, use_colors: bool | None = None) -> None:
        super().__init__()

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record.created)} {record.levelname:<7} {record.name}"
        request_id = _request_id(record)
        if request_id is not None:
            line += f" [{request_id}]"
        line += f" {record.getMessage().rstrip()}"
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        exc = _exc_info(record)
        if exc is not None:
            line += "\n" + _format_exception(exc)
        if record.stack_info:
            line += "\n" + record.stack_info
        return line


def logging_config(level: str, json: bool) -> dict[str, Any]:
    """The `logging.config.dictConfig` for the process: one stderr handler on the root logger."""
    formatter = "statestore.logs.JsonFormatter" if json else "statestore.logs.PlainFormatter"
    return {
        "version": 1,
        # Loggers created at import time (sqlalchemy, httpx, ours) must keep working.
        "disable_existing_loggers": False,
        # uvicorn writes `use_colors` into formatters named "default" and "access" when given --use-colors.
        "formatters": {"default": {"()": formatter}, "access": {"()": formatter}},
        "filters": {"cut_streams": {"()": "statestore.logs.DropCutStreamTracebacks"}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "stream": "ext://sys.stderr",
                "filters": ["cut_streams"],
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        # No handlers of their own: they propagate to root, so uvicorn's lines get our format too.
        "loggers": {
            **{name: {"level": level.upper(), "handlers": [], "propagate": True} for name in _UVICORN_LOGGERS},
            **{name: {"level": "WARNING", "handlers": [], "propagate": True} for name in _QUIETED_LOGGERS},
        },
    }


class DropCutStreamTracebacks(logging.Filter):
    """The server logs "Exception in ASGI application" with a traceback for every connection it cuts; a stream cut
    on purpose (StreamBrokenOff) is already logged once as a warning with the request id."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, StreamBrokenOff)


_configured: tuple[str, bool] | None = None


def configure_logging(level: str, json: bool) -> None:
    global _configured  # noqa: PLW0603 - remembered for uvicorn_log_config(), which runs once per process
    # Our formatters show neither source line, thread nor process: a record need not find them (a stack walk and
    # three lookups per line, a third of what an access line cost; the logging documentation's own optimisation).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging.config.dictConfig(logging_config(level, json))
    _configured = (level, json)


def uvicorn_log_config(level: str | None = None, json: bool | None = None) -> dict[str, Any] | None:
    """What to pass as uvicorn's `log_config` (with `access_log=False`).

    Without arguments: the config `configure_logging` last applied, or None (uvicorn then leaves logging
    alone) if it was never called. A dict rather than None because uvicorn applies `log_config` again in
    every worker process it spawns (`--workers N`), and a spawned worker does not inherit the parent's
    handlers; applying the same config twice in one process changes nothing.
    """
    if level is None and json is None:
        return None if _configured is None else logging_config(*_configured)
    default_level, default_json = _configured or ("INFO", True)
    return logging_config(level or default_level, default_json if json is None else json)
