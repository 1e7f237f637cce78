"""How many connections an HTTP server of idembus holds, and what it says when it runs out.

A served app (:class:`~idembus.gateway.serving.ServedApp`: the gateway, the dashboard, the
metrics endpoint) holds at most ``cap`` connections. When one more arrives, the connection
that has waited longest for a request (one that connected and sent nothing, or a
keep-alive connection between requests) is closed to make room: idle sockets cannot lock a
real client out. If every connection is busy (a request in progress, an open event stream),
the newcomer gets a fixed ``503`` and is closed (:mod:`~idembus.gateway.protocol`).

The cap is also kept below the descriptors the process may open (``ulimit -n``), with a
reserve for its broker and database connections, so that idle clients can never take the
descriptors the process needs to reconnect. Should ``accept()`` fail anyway for lack of
descriptors, asyncio's traceback per attempt (thousands a second) is replaced by one line
a second with a count.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..logs import Throttle

log = logging.getLogger(__name__)

#: Seconds between two log lines of one kind (turned away, evicted, accept failing).
LOG_INTERVAL = 1.0

#: What asyncio says when ``accept()`` fails for lack of descriptors or memory.
ACCEPT_EXHAUSTED = "socket.accept() out of system resource"

#: Connections turned away with a 503 that may still be closing (their answer being read),
#: as a share of the cap (at least :data:`LINGERING_AT_LEAST`); beyond, they are reset.
LINGERING_SHARE = 16
LINGERING_AT_LEAST = 4


def descriptor_limit() -> int | None:
    """The descriptors this process may open (the soft ``RLIMIT_NOFILE``), if known."""
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _reserve(limit: int) -> int:
    """Descriptors kept for the rest of the process: a quarter, at least 32."""
    return max(32, limit // 4)


def connection_cap(requested: int, limit: int | None) -> int:
    """``requested``, lowered if needed so that the cap and the connections lingering
    after a 503 leave a quarter of ``limit`` descriptors (at least 32) to the rest of the
    process."""
    if limit is None:
        return requested
    room = limit - _reserve(limit)
    return max(1, min(requested, room * LINGERING_SHARE // (LINGERING_SHARE + 1)))


def accept_backlog(most: int, limit: int | None) -> int:
    """How many connections asyncio may accept in one turn of its loop (the ``backlog`` it
    is given): at most ``most``, and a quarter of the reserve of :func:`connection_cap`
    when ``limit`` is known. They are accepted before the cap sees any of them (and the idle
    ones it closes free their descriptors a turn later): a burst must fit in the
    reserve."""
    if limit is None:
        return most
    return max(4, min(most, _reserve(limit) // 4))


#: What uvicorn logs once per bad connection (a flood of them is a flood of lines).
PER_CONNECTION_LINES = frozenset({"Invalid HTTP request received.",
                                  "Unsupported upgrade request."})


class PerConnectionLines(logging.Filter):
    """On uvicorn's logger: lets each of :data:`PER_CONNECTION_LINES` through once per
    :data:`LOG_INTERVAL` seconds, saying how many were held back."""

    def __init__(self) -> None:
        super().__init__()
        self.lines = Throttle(LOG_INTERVAL)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in PER_CONNECTION_LINES or record.args:
            return True
        self.lines.interval = LOG_INTERVAL
        held = self.lines.allow(str(record.msg))
        if held is None:
            return False
        record.msg = f"{record.msg} (a bad request; answered 400){self.lines.said(held)}"
        return True


def quiet_per_connection_lines(logger: logging.Logger) -> None:
    """Put a :class:`PerConnectionLines` on ``logger`` (once)."""
    if not any(isinstance(item, PerConnectionLines) for item in logger.filters):
        logger.addFilter(PerConnectionLines())


class ConnectionLimit:
    """The cap on one server's connections, what was done at it, and its log lines (one
    per kind and ``log_interval`` seconds, with how many were held back)."""

    def __init__(self, cap: int, *, name: str, log_interval: float | None = None) -> None:
        if cap < 1:
            raise ValueError(f"the connection cap must be at least 1, got {cap}")
        self.cap = cap
        self.name = name
        #: Connections turned away with a 503 (every connection busy).
        self.turned_away = 0
        #: Idle connections closed to make room for a new one.
        self.evicted = 0
        #: ``accept()`` failures for lack of descriptors or memory.
        self.exhausted = 0
        #: Turned-away connections still closing.
        self.lingering = 0
        #: Set once the server stops: a retry of ``accept()`` asyncio scheduled meets a
        #: closed socket then, and says so in one line, not a traceback.
        self.stopping = False
        self.lingering_cap = max(LINGERING_AT_LEAST, cap // LINGERING_SHARE)
        #: Lets one line of each kind through every :data:`LOG_INTERVAL` seconds.
        self.lines = Throttle(LOG_INTERVAL if log_interval is None else log_interval)

    def note_turned_away(self) -> None:
        """A connection was answered 503: the cap was reached and none was idle."""
        self.turned_away += 1
        self._say("busy", "%s: all of its %d connections are busy: turned new ones away "
                          "with 503", self.cap)

    def note_evicted(self) -> None:
        """An idle connection was closed to make room for a new one."""
        self.evicted += 1
        self._say("evicted", "%s: at its cap of %d connections: closed the one idle the "
                             "longest to admit a new one", self.cap)

    def exception_handler(self, loop: asyncio.AbstractEventLoop,
                          context: dict[str, Any]) -> None:
        """The event loop's exception handler: accept failures for lack of resources are
        counted and logged once a second, without a traceback; the rest as asyncio would."""
        error = context.get("exception")
        if context.get("message") != ACCEPT_EXHAUSTED:
            if self.stopping and isinstance(error, ValueError | OSError):
                log.debug("%s: while stopping: %s", self.name, context.get("message"))
                return
            loop.default_exception_handler(context)
            return
        self.exhausted += 1
        reason = getattr(error, "strerror", None) or type(error).__name__
        self._say("exhausted", "%s: cannot accept connections (%s); raise `ulimit -n` or "
                               "lower the connection cap (%d)", reason, self.cap)

    def _say(self, kind: str, message: str, *args: Any) -> None:
        held = self.lines.allow(kind)
        if held is not None:
            log.warning(message + "%s", self.name, *args, self.lines.said(held))
