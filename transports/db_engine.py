"""The engine of the transports that keep their queues in a database (PostgreSQL, MongoDB):
one consume loop, one way to lease, give back and reconnect, over a few primitives each
backend implements — as kombu's virtual channel asks a backend only for its gets and puts.

What the engine does, for every backend:

* ``consume``: a consumer claims up to ``prefetch`` due messages at a time (leased to this
  process), hands them to the callback one by one, and gives back at once what it left
  unsettled; it claims again at once while a claim says more may be waiting, else it waits
  — woken by the backend (a ``LISTEN``, a tailable cursor, a poll) — until the next
  delayed message or lease is due, at most ``max_idle_wait`` seconds. An outage
  (``TransportUnavailable``) is waited out with backoff (:class:`~.database.Reconnects`);
  a refusal only an operator can end (``BrokerAccessDenied``) is raised.
* Leases: every delivery a consumer or a tool holds unsettled has its lease renewed every
  third of ``visibility_timeout`` (:class:`~.database.LeaseKeeper`); acknowledging
  deletes it, requeueing clears its lease (it keeps its place).
* ``inspect``: a tool's claim, nothing moved aside, whatever is left unsettled given back
  when the block ends.

What a backend provides (:class:`DatabaseTransport`'s abstract methods): a consumer's
session (its own connection, or nothing) and idle waiter, a consumer's claim (moving
oversized and malformed messages aside inside the database), a tool's claim, the seconds an
idle consumer may wait, deleting a delivery's row, clearing leases, renewing them, and
closing what it holds. Sending, counting, ``get`` and ``browse`` are its own.
"""

from __future__ import annotations

import contextlib
import threading
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ..errors import ConfigurationError
from ..policies import Backoff
from .base import Delivery, OnDelivery, Transport
from .database import BodyLimits, BodyOnDemand, LeaseKeeper, Reconnects, deliver_claimed
from .errors import BrokerAccessDenied, TransportUnavailable


def check_times(visibility_timeout: float, max_idle_wait: float) -> None:
    """Refuse a lease or an idle wait that is not a positive number of seconds."""
    if visibility_timeout <= 0 or max_idle_wait <= 0:
        raise ConfigurationError(
            f"visibility_timeout and max_idle_wait must be positive seconds, got "
            f"{visibility_timeout!r} and {max_idle_wait!r}")


class ClaimedRow(BodyOnDemand, Delivery):
    """A delivery of a database transport: a stored message claimed under a lease token
    (or read, settled). Acknowledging deletes it and requeueing clears its lease, through
    its transport; neither does anything once a committed transaction deleted it
    (:attr:`removed`: the shared transaction)."""

    #: The claim's lease token (0: not claimed).
    lease: int = 0
    #: Its row was deleted by a committed transaction (the shared transaction).
    removed: bool = False
    _engine: DatabaseTransport[Any, Any]

    def _ack(self) -> None:
        if not self.removed:
            self._engine._delete(self)

    def _requeue(self) -> None:
        if not self.removed:
            self._engine._give_back([self])


D = TypeVar("D", bound=ClaimedRow)
S = TypeVar("S")


@dataclass(frozen=True)
class Claim(Generic[D]):
    """What one claim of a consumer got: its ``deliveries`` (leased, oldest due first),
    whether to claim ``again`` at once (more may be waiting), and the seconds until the
    next delayed message or lease of the queue is due, if the claim learnt it."""

    deliveries: list[D]
    again: bool
    due: float | None = None


class Waiter(Protocol):
    """How the idle consumers of one queue wait (a backend's)."""

    def claimed(self, claim: Claim[Any]) -> None:
        """A consumer claimed: ``claim`` (it may wake another, or poll sooner)."""

    def wait(self, seconds: float, stop: threading.Event) -> None:
        """Wait until woken, ``seconds`` passed, or ``stop`` is set."""


class DatabaseTransport(BodyLimits, Transport, Generic[D, S]):
    """The engine of a database transport (see the module docstring); a backend
    implements the abstract primitives, its deliveries are :class:`ClaimedRow`, and a
    consumer's session is an ``S`` (its connection, or ``None``)."""

    native_delay = True
    publisher_confirms = True

    #: Each consumer holds a connection of its own (:meth:`_session`): opening it proves
    #: the database reachable again, and starts the backoff of the next outage afresh (as
    #: every claim that succeeds does).
    connects_per_consumer = False

    def _start_engine(self, *, url: str, visibility_timeout: float, max_idle_wait: float,
                      backoff: Backoff | None, name: str) -> None:
        """Set the engine up: ``url`` as it may be shown, the lease and idle times, the
        reconnection backoff, the name of the lease thread."""
        self.visibility_timeout = visibility_timeout
        self.max_idle_wait = max_idle_wait
        self._reconnects = Reconnects(backoff, url)
        self._leases: LeaseKeeper[D] = LeaseKeeper(self.renew, visibility_timeout, name=name)

    # -- the primitives of a backend ------------------------------------------------------

    @abstractmethod
    def _session(self, queue: str) -> AbstractContextManager[S]:
        """What a consumer of ``queue`` claims with, opened (its connection), closed when
        the block ends; a failure to open it is a transport error."""

    @abstractmethod
    def _waiter(self, queue: str) -> AbstractContextManager[Waiter]:
        """How the consumers of ``queue`` in this process wait while idle."""

    @abstractmethod
    def _claim(self, session: S, queue: str, limit: int) -> Claim[D]:
        """A consumer's claim: up to ``limit`` due messages of ``queue``, leased and held by
        :attr:`_leases`; those over the queue's limits or unreadable are moved to its error
        queue inside the database, unread."""

    @abstractmethod
    def _take(self, queue: str, limit: int | None) -> list[D]:
        """A tool's claim: up to ``limit`` due messages of ``queue`` (all for ``None``),
        leased and held, none moved aside (a body over the limit stays in the database)."""

    @abstractmethod
    def _idle_wait(self, session: S, queue: str, claim: Claim[D]) -> float:
        """Seconds an idle consumer of ``queue`` waits after ``claim``: until the next
        delayed message or lease is due, at most ``max_idle_wait``."""

    @abstractmethod
    def _delete_row(self, delivery: D) -> None:
        """Delete ``delivery``'s message (acknowledged)."""

    @abstractmethod
    def _clear_leases(self, deliveries: Sequence[D]) -> None:
        """Clear the leases of ``deliveries`` that their claims still hold (they keep their
        places) and wake the idle consumers of their queue."""

    @abstractmethod
    def renew(self, deliveries: Sequence[D]) -> None:
        """Extend the leases of ``deliveries`` that their claims still hold (the lease
        keeper calls this every third of ``visibility_timeout``)."""

    @abstractmethod
    def _disconnect(self) -> None:
        """Close what the backend holds (connections, listeners)."""

    # -- settling -----------------------------------------------------------------------

    def _delete(self, delivery: D) -> None:
        """Acknowledge ``delivery``: delete its message; its lease is no longer renewed."""
        self._delete_row(delivery)
        self._leases.drop([delivery])

    def _give_back(self, deliveries: Sequence[D]) -> None:
        """Requeue ``deliveries``: clear their leases (they keep their places)."""
        if not deliveries:
            return
        self._clear_leases(deliveries)
        self._leases.drop(deliveries)

    # -- consuming ----------------------------------------------------------------------

    def consume(
        self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event, prefetch: int = 1
    ) -> None:
        """See the contract; outages are waited out here (reconnecting with backoff), and a
        refusal only an operator can end (``BrokerAccessDenied``) is raised."""
        failures = 0
        prefetch = max(1, prefetch)
        with self._waiter(queue) as waiter:
            while not stop.is_set():
                try:
                    with self._session(queue) as session:
                        if self.connects_per_consumer:
                            failures = 0
                        while not stop.is_set():
                            claim = self._claim(session, queue, prefetch)
                            failures = 0
                            waiter.claimed(claim)
                            deliver_claimed(claim.deliveries, on_delivery, stop,
                                            self._give_back)
                            if not claim.again:
                                waiter.wait(self._idle_wait(session, queue, claim), stop)
                except BrokerAccessDenied:
                    raise
                except TransportUnavailable as exc:
                    failures = self._reconnects.pause(queue, exc, failures, stop)

    # -- tools --------------------------------------------------------------------------

    @contextlib.contextmanager
    def inspect(self, queue: str, *, limit: int | None = None) -> Iterator[list[Delivery]]:
        """The messages due in ``queue`` now, claimed (their leases renewed while the block
        runs); see the contract. Those left unsettled go back to their places; had the
        process died, they would be due again after ``visibility_timeout``."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be at least 0, got {limit}")
        taken = [] if limit == 0 else self._take(queue, limit)
        try:
            yield list(taken)
        finally:
            self._give_back([delivery for delivery in taken if not delivery.settled])

    def close(self) -> None:
        """Renew no lease any more (those held run out) and close the connections."""
        self._leases.close()
        self._disconnect()
