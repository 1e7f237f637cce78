"""The driver: sends the orders to Sales, a share of them twice with the same message id,
and keeps sending through broker outages.

A publish that fails is retried, with the same envelope and so the same message id, until
the broker confirms it: a publish that reached the broker before the failure is then a
duplicate, which is harmless — deduplicating it is what idembus is for.

The transport is expected to report a broker outage as ``TransportUnavailable`` and to
reconnect by itself. Any other failure is recorded (the run reports it as a problem of the
library) and the driver carries on with a new transport, so that the rest of the run can
still be observed.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from idembus import Backoff
from idembus.envelope import Envelope
from idembus.routing import Router
from idembus.sending import Bus
from idembus.transports.base import Transport
from idembus.transports.errors import DestinationRefused, TransportUnavailable
from samples.ordering.messages import PlaceOrder
from samples.ordering.system import order_commands

log = logging.getLogger(__name__)

#: A duplicate sent "later" follows its first copy by up to this many other sends.
LATEST_DUPLICATE = 500


@dataclass(frozen=True)
class Send:
    """One publish of the plan."""

    command: PlaceOrder
    message_id: str


@dataclass(frozen=True)
class Plan:
    """The orders of a run and the order in which their PlaceOrder are sent."""

    order_ids: list[str]
    sends: list[Send]

    @classmethod
    def make(cls, orders: int, duplicates: int, *, seed: int) -> Plan:
        """Every order once (the demo's orders, :func:`order_commands`); ``duplicates`` of
        them a second time with the same message id, half right after the first copy (the
        two race at competing consumers), half up to :data:`LATEST_DUPLICATE` sends later
        (the first was processed and its effects dispatched already)."""
        rng = random.Random(f"duplicates/{seed}")
        keyed: list[tuple[float, Send]] = []
        order_ids = []
        for index, (command, message_id, twice) in enumerate(
                order_commands(orders, duplicates, seed=seed)):
            order_ids.append(command.order_id)
            keyed.append((index, Send(command, message_id)))
            if twice:
                later = 0 if rng.random() < 0.5 else rng.randint(1, LATEST_DUPLICATE)
                keyed.append((index + later + 0.5, Send(command, message_id)))
        keyed.sort(key=lambda pair: pair[0])
        return cls(order_ids, [send for _, send in keyed])

    def commands(self) -> dict[str, str]:
        """The id of each PlaceOrder sent, with its order id."""
        return {send.message_id: send.command.order_id for send in self.sends}


@dataclass
class DriverStats:
    """What sending took."""

    sent: int = 0
    #: Publishes repeated after a failure.
    retries: int = 0
    #: Failures the transport did not report as ``TransportUnavailable`` (type: message).
    unexpected_errors: list[str] = field(default_factory=list)


class Driver:
    """Sends a :class:`Plan` to the Sales queue of a deployment.

    ``halfway`` is called once, in the sending thread, when half the sends are done; the
    sends after it wait for the broker if it is down.
    """

    def __init__(
        self,
        make_transport: Callable[[], Transport],
        sales_queue: str,
        sends: Sequence[Send],
        *,
        halfway: Callable[[], None] | None = None,
        give_up_after: float = 300.0,
        backoff: Backoff | None = None,
    ) -> None:
        self._make_transport = make_transport
        self._transport = make_transport()
        self._sends = sends
        self._halfway = halfway
        self._give_up_after = give_up_after
        self._backoff = backoff or Backoff((0.1, 0.2, 0.5, 1.0))
        self._bus = Bus("torture-driver", Router({PlaceOrder: sales_queue}), self._dispatch)
        self.stats = DriverStats()

    def run(self) -> DriverStats:
        """Send everything; return the figures."""
        middle = len(self._sends) // 2
        try:
            for number, send in enumerate(self._sends):
                if number == middle and self._halfway is not None:
                    self._halfway()
                self._bus.send(send.command, message_id=send.message_id)
                self.stats.sent += 1
        finally:
            self._transport.close()
        return self.stats

    def _dispatch(self, envelope: Envelope) -> None:
        """Dispatch ``envelope`` until the broker confirms it."""
        failures = 0
        first_failure = 0.0
        while True:
            try:
                self._transport.dispatch(envelope)
            except TransportUnavailable as error:
                problem = f"{error}"
            except DestinationRefused:
                raise  # no endpoint declared the queue: waiting would not help
            except Exception as error:  # reported: the transport should have wrapped it
                problem = f"{type(error).__module__}.{type(error).__qualname__}: {error}"
                self.stats.unexpected_errors.append(problem)
                self._transport.close()
                self._transport = self._make_transport()
            else:
                if failures:
                    log.warning("driver: publishing works again after %.1fs and %d retries",
                                time.monotonic() - first_failure, failures)
                return
            if failures == 0:
                first_failure = time.monotonic()
                log.warning("driver: publishing %s failed (%s); retrying with the same id",
                            envelope.message_id, problem)
            elif time.monotonic() - first_failure > self._give_up_after:
                raise TransportUnavailable(
                    f"the driver could not publish for {self._give_up_after:.0f}s: {problem}")
            time.sleep(self._backoff.delay(failures))
            failures += 1
            self.stats.retries += 1
