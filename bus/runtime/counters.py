"""Counters of what an endpoint did, kept from its signals, and its ledger.

The signal counters count events: ``handled`` and ``duplicate`` once per handler, ``failed``
once per attempt, ``dispatched`` once per outgoing message. They do not add up to
``received``, which counts deliveries. The **ledger** does: every received delivery ends in
exactly one of its terms (:data:`LEDGER`), counted from the ``settled`` signal, so that

    received = handled + duplicate + dropped + retrying + dead_lettered + interrupted
               + in_flight

holds for every process at every moment (``in_flight``: received, not settled yet). A
delivery's term is what its handlers did as a whole (:attr:`IncomingMessage.effects
<idembus.pipeline.IncomingMessage.effects>`): *handled* when at least one handler
committed its effects, *duplicate* when none did and one found it processed before,
*dropped* when none ran on purpose; or where it went instead (*retrying*,
*dead_lettered*), or *interrupted* (an outage or a stop: the broker delivers it again, and
``received`` counts it again, as it does a delayed retry).

The ledger's terms are kept under the keys :func:`ledger_key` names beside the signal
counters, with two figures of the last settled delivery (:data:`LAST_SETTLED_AT`,
:data:`LAST_LAG_MS`): what ``idembus status`` and the dashboard show as the consumer's lag.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..envelope import parse_utc
from ..signals import SIGNAL_NAMES, EndpointSignals, Tally

#: The ledger's terms, in the order they are shown, each with what it means.
LEDGER: dict[str, str] = {
    "handled": "at least one handler committed its effects",
    "duplicate": "processed before: no effect applied again, what it sent is sent again",
    "dropped": "let go on purpose without effects: expired (discard_after), no saga for it, "
               "a completed saga's timeout, skipped",
    "retrying": "sent back to be tried later (a delayed retry, RetryLater, a limit); received "
                "again when it comes back",
    "dead_lettered": "moved to the error queue (or parked in the storage): failed every "
                     "retry, or unreadable",
    "interrupted": "stopped by an outage or a shutdown; the broker delivers it again",
    "in_flight": "received, not settled yet",
}
#: The terms counted from the ``settled`` signal (``in_flight`` is what is not settled).
SETTLED_TERMS = tuple(term for term in LEDGER if term != "in_flight")
#: Epoch milliseconds at which the last delivery was settled (a gauge: not added up).
LAST_SETTLED_AT = "last_settled_at_ms"
#: Milliseconds from when the last settled delivery was sent (or due, if it was delayed)
#: until it was settled: how far behind the consumer was (a gauge).
LAST_LAG_MS = "last_lag_ms"
#: The ``settled`` outcomes that are their own ledger term (else the handlers' ``effects``).
_TERM_OF_OUTCOME = {"skipped": "dropped", "retrying": "retrying", "retry_later": "retrying",
                    "dead_lettered": "dead_lettered", None: "interrupted"}


def ledger_key(term: str) -> str:
    """The counter key of ledger term ``term`` (``ledger_handled``...)."""
    return f"ledger_{term}"


def ledger(counters: dict[str, int] | Any) -> dict[str, int]:
    """The ledger of one snapshot of counters (or of their total): every term of
    :data:`LEDGER` and ``received``; ``in_flight`` is received minus settled."""
    terms = {term: int(counters.get(ledger_key(term), 0)) for term in SETTLED_TERMS}
    received = int(counters.get("received", 0))
    terms["in_flight"] = max(0, received - int(counters.get("settled", 0)))
    return {"received": received, **terms}


class Counters:
    """Counts every signal of one endpoint, and the ledger's terms; ``snapshot()`` returns
    the figures."""

    def __init__(self, signals: EndpointSignals) -> None:
        self._counts = dict.fromkeys(SIGNAL_NAMES, 0)
        self._counts.update(dict.fromkeys(map(ledger_key, SETTLED_TERMS), 0))
        self._lock = threading.Lock()
        #: (epoch seconds, time_sent, deliver_at) of the last settled delivery: its lag is
        #: worked out when asked for, not on every delivery.
        self._last: tuple[float, str | None, str | None] | None = None
        for name in SIGNAL_NAMES:
            if name == "settled":
                signals.settled.connect(self._settled)  # held weakly, as a method
            else:  # a count and nothing else, held by the signal (it holds no Counters)
                getattr(signals, name).connect(Tally(self._counts, self._lock, name),
                                               weak=False)

    def _settled(self, sender: object, *, outcome: str | None = None,
                 effects: str | None = None, time_sent: str | None = None,
                 deliver_at: str | None = None, **details: Any) -> None:
        term = _TERM_OF_OUTCOME.get(outcome) or effects or "dropped"
        lock = self._lock
        lock.acquire()  # not a with block: no __enter__ and __exit__ looked up each time
        try:
            counts = self._counts
            counts["settled"] += 1
            counts["ledger_" + term] += 1
            self._last = (time.time(), time_sent, deliver_at)
        finally:
            lock.release()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
            last = self._last
        if last is not None:
            counts[LAST_SETTLED_AT] = int(last[0] * 1000)
            lag = _lag_ms(*last)
            if lag is not None:
                counts[LAST_LAG_MS] = lag
        return counts

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts[name]


def _lag_ms(settled_at: float, time_sent: str | None, deliver_at: str | None) -> int | None:
    """Milliseconds from the later of ``time_sent`` and ``deliver_at`` to ``settled_at``
    (``None`` without a readable time; never below 0: clocks differ between machines)."""
    moments = [moment for moment in (parse_utc(time_sent), parse_utc(deliver_at))
               if moment is not None]
    if not moments:
        return None
    return max(0, int((settled_at - max(moments).timestamp()) * 1000))
