"""OpenTelemetry metrics of an endpoint, from its signals (:mod:`idembus.signals`)::

    from idembus.observability.metrics import Metrics

    Endpoint("sales", middleware=[Metrics()], ...)  # the global meter provider

``Metrics`` is given as middleware (:mod:`idembus.pipeline`) so that the endpoint sets it up
and closes it, but it overrides no per-message hook: every instrument is fed by a signal, so
a figure ``idembus status`` shows and its OpenTelemetry instrument come from one report.

Needs ``opentelemetry-api`` only (``pip install 'idembus[otel]'``); the application chooses
an SDK and an exporter (``idembus run --metrics-port N`` serves them to Prometheus).

Instruments (Prometheus names, as the OpenTelemetry Prometheus exporter renders them, in
brackets):

counters of messages, with attributes ``endpoint``, ``message_type`` and, where a handler
is concerned, ``handler``; they count the endpoint's signals (:mod:`idembus.signals`), the
figures ``idembus status`` shows:

* ``idembus.messages.received`` [``idembus_messages_received_total``]: deliveries;
* ``idembus.messages.handled`` [``..._handled_total``]: a handler committed its effects;
* ``idembus.messages.duplicates`` [``..._duplicates_total``]: a handler found the message
  already processed;
* ``idembus.messages.redispatched`` [``..._redispatched_total``]: a duplicate sent the
  stored outgoing messages again;
* ``idembus.messages.failed`` [``..._failed_total``]: a handler attempt raised (with
  ``error_type``);
* ``idembus.messages.retried`` [``..._retried_total``]: a failed message is tried again
  (``kind``: ``immediate`` or ``delayed``);
* ``idembus.messages.dead_lettered`` [``..._dead_lettered_total``]: moved to the error
  queue (with ``error_type``);
* ``idembus.messages.discarded`` [``..._discarded_total``]: a handler did not run on a
  message received after its ``idembus.discard_after`` (:mod:`idembus.expiry`);
* ``idembus.messages.not_found`` [``..._not_found_total``]: a saga's message found no
  saga and does not start one (acknowledged);
* ``idembus.messages.timeouts_dropped`` [``..._timeouts_dropped_total``]: a saga's timeout
  arrived once the saga was completed (acknowledged);
* ``idembus.messages.unordered`` [``..._unordered_total``]: a message of an ordered type
  arrived without its ordering key (a sender that did not know a handler's declaration;
  handled, not in order);

histograms, in seconds, with ``endpoint`` and ``message_type``:

* ``idembus.message.handling.duration`` [``idembus_message_handling_duration_seconds``]:
  from the arrival of a delivery until it is settled, with ``outcome`` (``handled``,
  ``skipped``, ``retry_later``, ``retrying``, ``dead_lettered``, ``discarded``, or
  ``interrupted``);
* ``idembus.message.critical_time`` [``idembus_message_critical_time_seconds``]: from
  ``idembus.time_sent`` until the message was handled (what a user waits for);

and a counter ``idembus.message.critical_time.implausible``
[``idembus_message_critical_time_implausible_total``], by ``endpoint``, ``message_type``
and ``reason`` (``future`` or ``too_old``): handled messages whose ``idembus.time_sent``
— written by their sender, whoever that is — lies further ahead than ``clock_skew`` or
further back than ``plausible_critical_time`` (7 days unless told otherwise). They are
counted there instead of in the histogram, whose sum one forged header could otherwise
push by decades;

and an up-down counter ``idembus.messages.in_flight`` [``idembus_messages_in_flight``] by
``endpoint``: deliveries being processed now.

``message_type`` is the wire name of a type the endpoint knows, or ``unknown``: a
producer sending arbitrary type names cannot create arbitrarily many series.
"""

from __future__ import annotations

import datetime
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any

from ..envelope import parse_utc, utc_now
from ..messages import message_aliases, message_name
from ..pipeline import Middleware

try:
    from opentelemetry import metrics
    from opentelemetry.metrics import Counter, MeterProvider
except ImportError as missing:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"idembus.observability.metrics needs opentelemetry-api: "
        f"pip install 'idembus[otel]' ({missing})"
    ) from missing

#: Signal -> (instrument name, description).
COUNTERS = {
    "received": ("idembus.messages.received", "Deliveries received"),
    "handled": ("idembus.messages.handled", "Messages a handler committed its effects for"),
    "duplicate": ("idembus.messages.duplicates",
                  "Messages a handler found already processed"),
    "redispatched": ("idembus.messages.redispatched",
                     "Duplicates that sent the stored outgoing messages again"),
    "failed": ("idembus.messages.failed", "Handler attempts that raised"),
    "retried": ("idembus.messages.retried", "Failed messages tried again"),
    "dead_lettered": ("idembus.messages.dead_lettered", "Messages moved to the error queue"),
    "discarded": ("idembus.messages.discarded",
                  "Messages a handler did not run on: received after their discard_after"),
    "not_found": ("idembus.messages.not_found",
                  "Saga messages that found no saga and do not start one"),
    "timeout_dropped": ("idembus.messages.timeouts_dropped",
                        "Saga timeouts that arrived once their saga was completed"),
    "unordered": ("idembus.messages.unordered",
                  "Messages of an ordered type that arrived without their ordering key"),
}
HANDLING_DURATION = "idembus.message.handling.duration"
CRITICAL_TIME = "idembus.message.critical_time"
IMPLAUSIBLE_CRITICAL_TIME = "idembus.message.critical_time.implausible"
#: The longest critical time recorded unless told otherwise: older is a replay, a sender's
#: clock or a forged ``idembus.time_sent``, not a wait anyone had.
PLAUSIBLE_CRITICAL_TIME = datetime.timedelta(days=7)
#: How far ahead of this endpoint's clock a sender's clock may be (recorded as 0 s).
CLOCK_SKEW = datetime.timedelta(minutes=5)
IN_FLIGHT = "idembus.messages.in_flight"

#: Bucket boundaries (seconds) of both histograms: from 5 ms to an hour.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
           300.0, 900.0, 3600.0)
#: Message type label of a type the endpoint does not know.
UNKNOWN = "unknown"
#: Attribute sets kept for reuse, at most.
_CACHED = 4096

Attributes = Mapping[str, str]


class Metrics(Middleware):
    """Counters, histograms and in-flight of the endpoints it is given to (see the module
    docstring). ``meter_provider``: where the instruments live (default: the global one,
    looked up through the OpenTelemetry API's proxy, so it may be set after this middleware
    is created). A handled message's critical time is recorded when its
    ``idembus.time_sent`` is at most ``clock_skew`` ahead and ``plausible_critical_time``
    behind; otherwise it is counted as implausible. One instance may serve several
    endpoints."""

    def __init__(self, meter_provider: MeterProvider | None = None, *,
                 plausible_critical_time: datetime.timedelta = PLAUSIBLE_CRITICAL_TIME,
                 clock_skew: datetime.timedelta = CLOCK_SKEW) -> None:
        if plausible_critical_time <= datetime.timedelta(0) or clock_skew < datetime.timedelta(0):
            raise ValueError(
                "plausible_critical_time must be positive and clock_skew not negative, got "
                f"{plausible_critical_time!r} and {clock_skew!r}")
        #: The provider given, or ``None`` for the global one.
        self.meter_provider = meter_provider
        self._plausible = plausible_critical_time.total_seconds()
        self._skew = clock_skew.total_seconds()
        meter = metrics.get_meter("idembus", _version(), meter_provider=meter_provider)
        self._counters: dict[str, Counter] = {
            signal: meter.create_counter(name, unit="{message}", description=description)
            for signal, (name, description) in COUNTERS.items()}
        self._duration = _histogram(meter, HANDLING_DURATION,
                                    "Time from the arrival of a delivery until it is settled")
        self._critical = _histogram(meter, CRITICAL_TIME,
                                    "Time from idembus.time_sent until the message was "
                                    "handled")
        self._implausible = meter.create_counter(
            IMPLAUSIBLE_CRITICAL_TIME, unit="{message}",
            description="Handled messages whose idembus.time_sent lies in the future or too "
                        "far back to be a critical time")
        self._in_flight = meter.create_up_down_counter(
            IN_FLIGHT, unit="{message}", description="Deliveries being processed")
        #: Wire names of the message types each endpoint set up with this one knows.
        self._known: dict[str, frozenset[str]] = {}
        #: Attribute dicts by their values: built once, passed to every measurement.
        self._attributes: dict[tuple[str, ...], Attributes] = {}
        #: (signal, receiver) pairs to disconnect on close.
        self._connected: list[tuple[Any, Callable[..., None]]] = []

    def setup(self, endpoint: Any) -> None:
        """Watch the endpoint's signals; learn the message types it knows."""
        self._known[endpoint.name] = frozenset(
            name for t in endpoint.registry for name in (message_name(t), *message_aliases(t)))
        receivers = {name: self._receiver(name) for name in COUNTERS}
        receivers["received"] = self._received(receivers["received"])
        receivers["settled"] = self._settled
        for signal_name, receiver in receivers.items():
            signal = getattr(endpoint.signals, signal_name)
            signal.connect(receiver, weak=False)
            self._connected.append((signal, receiver))

    def close(self) -> None:
        """Stop watching the signals of the endpoints set up."""
        for signal, receiver in self._connected:
            signal.disconnect(receiver)
        self._connected.clear()

    # -- counters -------------------------------------------------------------------------

    def _receiver(self, signal_name: str) -> Callable[..., None]:
        counter = self._counters[signal_name]

        def count(endpoint: str, **details: Any) -> None:
            extra: list[str] = []
            error = details.get("error")
            if error is not None:
                extra += ["error_type", type(error).__name__]
            kind = details.get("kind")
            if isinstance(kind, str):
                extra += ["kind", kind]
            counter.add(1, self._labels(endpoint, details.get("message_type"),
                                        details.get("handler"), *extra))

        return count

    # -- deliveries: received ... settled -------------------------------------------------

    def _received(self, count: Callable[..., None]) -> Callable[..., None]:
        def received(endpoint: str, **details: Any) -> None:
            count(endpoint, **details)
            self._in_flight.add(1, self._labels(endpoint))

        return received

    def _settled(self, endpoint: str, *, outcome: str | None = None, seconds: float = 0.0,
                 message_type: str | None = None, time_sent: str | None = None,
                 **details: Any) -> None:
        self._in_flight.add(-1, self._labels(endpoint))
        outcome = outcome or "interrupted"
        self._duration.record(seconds, self._labels(endpoint, message_type, None,
                                                    "outcome", outcome))
        if outcome != "handled":
            return
        sent = parse_utc(time_sent)
        if sent is None:
            return
        critical = (utc_now() - sent).total_seconds()
        if -self._skew <= critical <= self._plausible:
            # A sender's clock a little ahead: 0 s rather than a negative time.
            self._critical.record(max(0.0, critical), self._labels(endpoint, message_type))
        else:
            self._implausible.add(1, self._labels(
                endpoint, message_type, None, "reason", "future" if critical < 0 else "too_old"))

    # -- attributes -----------------------------------------------------------------------

    def _labels(self, endpoint: str, message_type: str | None = None,
                handler: str | None = None, *extra: str) -> Attributes:
        """The attribute dict of these values, built once; ``extra`` are name, value
        pairs."""
        if message_type is not None:
            known = self._known.get(endpoint)
            if known is not None and message_type not in known:
                message_type = UNKNOWN
        key = (endpoint, "\0" if message_type is None else message_type, handler or "",
               *extra)
        attributes = self._attributes.get(key)
        if attributes is not None:
            return attributes
        built = {"endpoint": endpoint}
        if message_type is not None:
            built["message_type"] = message_type or UNKNOWN
        if handler:
            built["handler"] = handler
        built.update(zip(extra[::2], extra[1::2], strict=True))
        if len(self._attributes) < _CACHED:
            self._attributes[key] = built
        return built


def _histogram(meter: metrics.Meter, name: str, description: str) -> metrics.Histogram:
    try:
        return meter.create_histogram(name, unit="s", description=description,
                                      explicit_bucket_boundaries_advisory=BUCKETS)
    except TypeError:  # pragma: no cover - an opentelemetry-api before the advisory
        return meter.create_histogram(name, unit="s", description=description)


def _version() -> str:
    try:
        return importlib.metadata.version("idembus")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
        return ""
