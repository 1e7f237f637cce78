"""Pieces shared by both sides of the throughput benchmark.

Both the idembus flow and the raw kombu loop take their broker URL, their kombu options,
their prefetch and their input messages from here, so that the two sides are configured
identically by construction rather than by convention.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from idembus.redaction import redact
from samples.ordering.messages import PlaceOrder

AMQP_URL = os.environ.get("IDEMBUS_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
TRANSPORT_URLS = {"memory": "memory://", "amqp": AMQP_URL}

#: Endpoint's default prefetch; the raw consumers use the same.
PREFETCH = 16
#: KombuTransport's default polling interval on memory:// (kombu's own default is 1 s);
#: passed explicitly to both sides.
MEMORY_POLLING_INTERVAL = 0.005
#: How long one wait for deliveries lasts before a stop flag is looked at (as in idembus).
DRAIN_TIMEOUT = 0.1


def unique_suffix() -> str:
    """A short random suffix that keeps one run's queues and exchanges apart from others."""
    return uuid.uuid4().hex[:10]


def is_amqp(url: str) -> bool:
    return url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")


def display_url(url: str) -> str:
    """``url`` without its password."""
    parsed = urlparse(url)
    if not parsed.password:
        return url
    return url.replace(f":{parsed.password}@", ":**@", 1)


def kombu_options(url: str, *, confirm: bool) -> dict[str, Any]:
    """The kombu ``transport_options`` KombuTransport derives from the same settings
    (``confirm_publish`` on amqp when confirms are wanted, 5 ms polling on memory://)."""
    if is_amqp(url):
        return {"confirm_publish": True} if confirm else {}
    if url.startswith("memory://"):
        return {"polling_interval": MEMORY_POLLING_INTERVAL}
    return {}


def unreachable_reason(url: str) -> str | None:
    """Why the broker at ``url`` cannot be used, or ``None`` if something listens there."""
    if not is_amqp(url):
        return None
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 5672
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        return f"RabbitMQ is not reachable at {host}:{port} ({exc})"
    return None


def postgres_unreachable_reason(url: str) -> str | None:
    """Why the PostgreSQL server at ``url`` cannot be used, or ``None`` if it answers."""
    import psycopg  # only where PostgreSQL is measured

    try:
        psycopg.connect(url, connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL is not reachable at {display_url(url)} ({redact(str(exc)).strip()})"
    return None


def orders(count: int) -> Iterator[PlaceOrder]:
    """The ``count`` PlaceOrder commands every variant starts from (distinct orders)."""
    for index in range(count):
        yield PlaceOrder(order_id=f"order-{index:07d}", customer=f"customer-{index % 17}",
                         amount_cents=100 + (index * 7919) % 100_000)


class FlowClock:
    """Times one flow: from the first message taken off the input queue until the last
    stage has finished ``expected`` messages. Connection set-up is not timed."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.finished = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._start: float | None = None
        self._end: float | None = None

    def start(self) -> None:
        """Note the first message; later calls do nothing."""
        if self._start is None:
            with self._lock:
                if self._start is None:
                    self._start = time.perf_counter()

    def finish_one(self) -> None:
        with self._lock:
            self.finished += 1
            if self.finished == self.expected:
                self._end = time.perf_counter()
                self._done.set()

    def wait(self, timeout: float) -> float:
        """Block until the flow is done; return its duration in seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"only {self.finished} of {self.expected} messages finished in {timeout:.0f}s"
            )
        assert self._start is not None and self._end is not None
        return self._end - self._start


def timeout_for(messages: int, *, least_rate: float = 20.0) -> float:
    """A generous limit: a flow slower than ``least_rate`` messages/s (20; under callgrind,
    which runs Python tens of times slower, less) is broken, not slow."""
    return max(60.0, messages / least_rate)


@dataclass
class Measurement:
    """Every timed run of one variant on one transport."""

    variant: str
    messages: int
    seconds: list[float] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [self.messages / s for s in self.seconds]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def as_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "messages": self.messages,
                "seconds": [round(s, 4) for s in self.seconds],
                "msgs_per_s": [round(r, 1) for r in self.rates],
                "median_msgs_per_s": round(self.median, 3)}
