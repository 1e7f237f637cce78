"""What an endpoint tells its operator through the standard ``logging`` module.

* :class:`MessageLog`: at DEBUG, one line per message and handler — received, handled,
  duplicate, redispatched, dispatched, not_found, timeout_dropped — with ids and
  milliseconds, from the endpoint's
  signals (connected only when DEBUG is on for ``idembus.messages``, so it costs nothing
  otherwise).
* :class:`Throttle`: one line per cause per interval, with how many were held back, for
  messages that repeat while something stays broken (an outage): a message that waits
  (:mod:`idembus.runtime.processing`), an endpoint's helper threads
  (:mod:`idembus.runtime.background`),
  its status reports (:mod:`idembus.runtime.status`) and a consumer reconnecting
  (:mod:`idembus.transports.kombu`).
* :class:`JsonFormatter`: one JSON object per line (``idembus run --log-format json``),
  redacted like every other line.
* :func:`configure`: the logging of an ``idembus`` command — stderr, redacted, text or
  JSON — and :func:`log_uncaught`, which sends what Python would print raw (an uncaught
  exception's traceback, in any thread) through that same redacting handler.
* :func:`message_context`, :class:`ContextFilter` and :func:`message_logger`: the message
  being processed, its handler and attempt, on every record logged meanwhile — idembus's
  own lines (through :func:`message_logger`) and, once the filter is on a handler (as
  :func:`configure` puts it), a handler's own ``logging`` calls.
* :func:`log_per_message`: one INFO line per processed message with its outcome and
  duration (``idembus run --log-per-message``); at DEBUG without it.

Records carry ``endpoint``, ``message_id``, ``message_type``, ``handler`` and ``attempt``
where they concern one message; the JSON lines show them as fields (with ``pid``, and
``worker`` in a worker of ``idembus run --workers``), the text lines in a prefix. What came from a
message's sender (its id, its type name, a header) is written escaped and bounded
(:func:`~idembus.loggable.loggable`): no line break of a sender's making starts a line of
its own, and no 70 KB type name fills the log.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .redaction import RedactingFormatter, redact
from .signals import EndpointSignals

#: The logger of the per-message lines.
MESSAGES = logging.getLogger("idembus.messages")
#: The logger of exceptions nothing caught (:func:`log_uncaught`).
UNCAUGHT = logging.getLogger("idembus.uncaught")
#: The logger of the one line per processed message (:func:`log_per_message`).
PER_MESSAGE = logging.getLogger("idembus.per_message")
#: The text lines of ``idembus`` commands (:class:`TextFormatter` fills ``context``).
TEXT_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s%(context)s: %(message)s"
#: Fields a record may carry about its message, shown by the JSON lines.
FIELDS = ("endpoint", "message_id", "message_type", "handler", "attempt")
#: Fields of the per-message line (:func:`log_per_message`), shown by the JSON lines only.
_RESULT_FIELDS = ("outcome", "duration_ms")
#: The environment variable naming a worker of ``idembus run --workers`` (from 0).
WORKER = "IDEMBUS_WORKER"
_EVENTS = ("received", "handled", "duplicate", "redispatched", "dispatched", "not_found",
           "timeout_dropped")


class MessageLog:
    """DEBUG lines for one endpoint's messages; see the module docstring."""

    def __init__(self, signals: EndpointSignals) -> None:
        self._signals = signals
        self._started = threading.local()

    def connect(self) -> bool:
        """Follow the signals if DEBUG is on for :data:`MESSAGES`; True if it does."""
        if not MESSAGES.isEnabledFor(logging.DEBUG):
            return False
        for name in _EVENTS:
            getattr(self._signals, name).connect(self._receiver(name), weak=False)
        return True

    def _receiver(self, event: str) -> Any:
        def receive(endpoint: str, **details: Any) -> None:
            if event == "received":
                self._started.at = time.monotonic()
            started = getattr(self._started, "at", None)
            elapsed = (time.monotonic() - started) * 1000 if started is not None else 0.0
            fields: dict[str, Any] = {
                **_CONTEXT.get(), "endpoint": endpoint,
                **{key: _field(details.get(key)) for key in FIELDS[1:4]}}
            if event == "dispatched":  # about the message sent, not the one handled
                fields["attempt"] = None
            by = f" by {details['handler']}" if details.get("handler") else ""
            MESSAGES.debug("%s %s %s %s%s (%.1f ms)", endpoint, event,
                           fields["message_type"] or "-", fields["message_id"] or "-",
                           by, elapsed, extra=fields)
        return receive


class Throttle:
    """Lets one line per key through every ``interval`` seconds; thread-safe."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> int | None:
        """How many lines of ``key`` were held back since the last one, if this one may be
        written now; ``None`` if it is held back."""
        now = time.monotonic()
        lock = self._lock
        lock.acquire()  # not a with block: an unrouted event asks for every one
        try:
            last, held = self._last.get(key, (None, 0))
            if last is not None and now - last < self.interval:
                self._last[key] = (last, held + 1)
                return None
            self._last[key] = (now, 0)
            return held
        finally:
            lock.release()

    def said(self, held: int) -> str:
        """What a line let through adds about the ``held`` ones before it (``""``: none)."""
        return f" ({held} more such line(s) held back in {self.interval:g}s)" if held else ""


class JsonFormatter(RedactingFormatter):
    """One JSON object per record: time (UTC), level, logger, message, ``pid``, ``worker``
    (the index of a worker of ``idembus run --workers``: ``worker``, by default the
    ``IDEMBUS_WORKER`` environment variable its supervisor sets; absent elsewhere), the
    message's fields where the record has them, and the traceback; every value redacted."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker if worker is not None else _worker_index()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
            "pid": record.process,
        }
        if self.worker is not None:
            entry["worker"] = self.worker
        for key in FIELDS + _RESULT_FIELDS:
            value = getattr(record, key, None)
            if isinstance(value, int | float) and not isinstance(value, bool):
                entry[key] = value
            elif value is not None:
                entry[key] = redact(_bounded(str(value)))
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(RedactingFormatter):
    """The text lines of ``idembus`` commands (:data:`TEXT_FORMAT`): after the logger's
    name, the message's fields a record has, as ``[endpoint=orders message_id=…
    message_type=shop.PlaceOrder handler=Billing attempt=2]``; redacted."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def format(self, record: logging.LogRecord) -> str:
        shown = [f"{key}={_bounded(str(value))}" for key in FIELDS
                 if (value := getattr(record, key, None)) is not None]
        record.context = f" [{' '.join(shown)}]" if shown else ""
        return super().format(record)


def _worker_index() -> int | None:
    """This process's index among the workers of ``idembus run --workers`` (``None``
    elsewhere)."""
    try:
        return int(os.environ[WORKER])
    except (KeyError, ValueError):
        return None


def _bounded(text: str) -> str:
    """A field of a JSON line: JSON escapes line breaks itself, so only its length is
    bounded (a value escaped by :func:`~idembus.loggable.loggable` already stays whole)."""
    return text if len(text) <= 2 * LIMIT else loggable(text)


def _field(value: object) -> str | None:
    """A message's id or type (from its sender) as a log record's field: escaped and
    bounded (:func:`~idembus.loggable.loggable`)."""
    return None if value is None else loggable(value)


def configure(level: str, form: str) -> None:
    """Log to stderr at ``level`` through a redacting formatter — ``text`` lines or
    ``json`` objects — uncaught exceptions included (:func:`log_uncaught`): no line, and
    no traceback a driver or a thread wrote, carries a password."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if form == "json" else TextFormatter())
    handler.addFilter(ContextFilter())  # a handler's own lines carry the message's fields
    logging.basicConfig(level=level.upper(), handlers=[handler])
    log_uncaught()


# -- the message being processed, on every record -------------------------------------

#: The fields of the message this thread (or task) is processing: set by
#: :func:`message_context`, read by :class:`ContextFilter` and :func:`message_logger`.
_NO_FIELDS: Mapping[str, Any] = types.MappingProxyType({})
_CONTEXT: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "idembus_message_context", default=_NO_FIELDS)


class message_context:  # noqa: N801 - called as a function; a class saves a call
    """Within the block, records logged by this thread (and the tasks it starts) carry
    ``fields`` (over those of an enclosing block; ``None`` removes one): the endpoint
    sets ``endpoint``, ``message_id``, ``message_type`` around each message and
    ``handler`` and ``attempt`` around each handler attempt. Values from the wire must be
    passed through :func:`loggable` first.

    A context manager class rather than a function returning a generator's: the endpoint
    enters two of them for every message."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields
        self._token: contextvars.Token[Mapping[str, Any]] | None = None

    def __enter__(self) -> None:
        fields = self._fields
        merged = {**_CONTEXT.get(), **fields}  # the enclosing block's fields hold no None
        if None in fields.values():
            merged = {key: value for key, value in merged.items() if value is not None}
        self._token = _CONTEXT.set(merged)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._token is not None:
            _CONTEXT.reset(self._token)
            self._token = None


def current_context() -> dict[str, Any]:
    """The fields :func:`message_context` set for this thread or task (empty outside)."""
    return dict(_CONTEXT.get())


class ContextFilter(logging.Filter):
    """Adds the fields of the message being processed (:func:`message_context`) to every
    record that has not got them: put it on a log handler and a handler's own
    ``logging`` calls carry ``endpoint``, ``message_id``, ``message_type``, ``handler``
    and ``attempt``, as Celery's task logger adds the task's id::

        handler = logging.StreamHandler()
        handler.addFilter(idembus.logs.ContextFilter())

    ``idembus run`` puts it on its own handler. It never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _CONTEXT.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:
    _Adapter = logging.LoggerAdapter


class MessageLogger(_Adapter):
    """A logger whose records carry the fields of the message being processed
    (:func:`message_context`) whatever handlers and filters the application has; what a
    call passes in ``extra=`` wins."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        fields = _CONTEXT.get()
        if fields:
            kwargs["extra"] = {**fields, **(kwargs.get("extra") or {})}
        return msg, kwargs


def message_logger(name: str) -> MessageLogger:
    """The :class:`MessageLogger` of logger ``name`` (a module's ``__name__``)."""
    return MessageLogger(logging.getLogger(name), {})


def log_per_message(enabled: bool = True) -> None:
    """Log one INFO line per processed message on :data:`PER_MESSAGE` (``idembus run
    --log-per-message``): its outcome and how long it took, as Celery's worker does;
    without it the line is logged at DEBUG."""
    PER_MESSAGE.setLevel(logging.INFO if enabled else logging.NOTSET)


def per_message_level() -> int | None:
    """The level of the per-message line: INFO once :func:`log_per_message` switched it
    on, DEBUG if that is enabled for :data:`PER_MESSAGE`, else ``None`` (no line)."""
    if PER_MESSAGE.level and PER_MESSAGE.level <= logging.INFO:
        return logging.INFO
    return logging.DEBUG if PER_MESSAGE.isEnabledFor(logging.DEBUG) else None


def log_uncaught() -> None:
    """Log to :data:`UNCAUGHT` what Python would otherwise print raw to stderr: an exception
    nothing caught in the main thread (``sys.excepthook``, CRITICAL) or in another thread
    (``threading.excepthook``, ERROR), and one it could only ignore, in a ``__del__`` say
    (``sys.unraisablehook``, WARNING). The handlers of a command (:func:`configure`) then
    format and redact them like every other line. Call it once logging is configured;
    calling it again changes nothing."""
    sys.excepthook = _uncaught
    threading.excepthook = _uncaught_in_thread
    sys.unraisablehook = _unraisable


def _uncaught(kind: type[BaseException], error: BaseException,
              trace: TracebackType | None) -> None:
    UNCAUGHT.critical("uncaught %s: the command ends", kind.__name__,
                      exc_info=(kind, error, trace))


def _uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as Python does: a thread may end itself so
        return
    name = args.thread.name if args.thread is not None else "?"
    error = args.exc_value if args.exc_value is not None else args.exc_type()
    UNCAUGHT.error("uncaught %s in thread %s", args.exc_type.__name__, name,
                   exc_info=(args.exc_type, error, args.exc_traceback))


def _unraisable(unraisable: Any) -> None:
    try:
        where = repr(unraisable.object)
    except Exception:
        where = "an object whose repr failed"
    said = unraisable.err_msg or "Exception ignored in"
    error = unraisable.exc_value
    UNCAUGHT.warning("%s: %s", said, redact(where),
                     exc_info=(unraisable.exc_type, error, unraisable.exc_traceback)
                     if error is not None else None)


# -- values from the wire in a log line ------------------------------------------------

#: Longest value from the wire a log line carries, in characters (a uuid has 36).
LIMIT = 200
_CUT = "…"


def loggable(value: object, limit: int = LIMIT) -> str:
    """``value`` as a log line may carry it: unchanged when it is printable text of at most
    ``limit`` characters; otherwise quoted and escaped as ``repr`` does (line breaks,
    control and format characters as ``\\n``, ``\\x1b``, ``\\u2028``), cut at ``limit``
    characters with an ellipsis and its full length: ``'xxxx…' (70000 characters)``."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit and text.isprintable():
        return text
    shown = repr(text[:limit])
    quote, inner = shown[0], shown[1:-1]
    if len(text) <= limit and len(inner) <= limit:
        return shown
    return f"{quote}{inner[:limit]}{_CUT}{quote} ({len(text)} characters)"
