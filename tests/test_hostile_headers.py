"""Any value in any ``idembus.*`` header is handled or dead-lettered at once: never retried
as if a dependency were down, never weighed by the circuit breaker (issue 24, finding 3).

``str.isdigit`` takes ``²`` and ``①``, which ``int`` refuses: a ``ValueError`` escaped the
decoder, was taken for a failing hook, went through every retry round and counted towards
the breaker (15 tiny messages paused an endpoint for over a minute). The endpoint's real
processor is driven directly (no broker, no threads), with tracing and metrics middleware
in place so that their hooks read the hostile headers too; the breaker's threshold is 1,
so that a single counted failure shows as a ``paused`` signal, and the endpoint is told to
stop, so that a wait for an outage raises (and the delivery is requeued) instead of
blocking the test.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.logs import JsonFormatter, TextFormatter
from idembus.observability.metrics import Metrics
from idembus.observability.tracing import Tracing
from idembus.pipeline import IncomingMessage, Middleware
from idembus.policies import Backoff
from idembus.runtime.recoverability.breaker import BreakerPolicy
from idembus.runtime.recoverability.policy import Recoverability
from idembus.runtime.requests import FAILURE_TYPE
from idembus.storage.memory import MemoryStorage
from idembus.transports.base import Transport
from idembus.wire import text_headers
from tests.support import AccountHandler, Deposit, DrivenTransport, RecordedDelivery, SignalCounter

QUEUE = "accounts"
ERROR_QUEUE = "accounts-error"
#: Every idembus header a message may carry, as the wire format names them.
IDEMBUS_HEADERS = sorted(value for name, value in vars(h).items()
                         if name.isupper() and isinstance(value, str)
                         and value.startswith("idembus."))
#: Headers another library reads from the same table (tracing's middleware).
TRACE_HEADERS = ["traceparent", "tracestate", "baggage"]
#: What the error-queue copy of a message refused for its own fault names as the reason.
ITS_OWN_FAULT = {"idembus.errors.MalformedMessage", "idembus.errors.InvalidMessage",
                 "idembus.errors.UnknownMessageType"}
#: Digits ``str.isdigit`` (some even ``str.isdecimal``) takes and ASCII does not have.
UNICODE_DIGITS = "²³¹①⑨٣۴߅०১੩૪୫௬౭೮൯๑໒༣၄႕០᠑᥆᧑᪂᭓᮴᱅᱖꘠꣐꤁꧑꩒꯳０１９𝟎𝟗"
BODY = Deposit(account="a", amount=1).model_dump_json().encode()


class RecordingTransport(DrivenTransport):
    """Keeps what the endpoint sends: error-queue copies, messages sent back to its own
    queue (a delayed retry or a postponement) and the failure replies a dead-lettered
    request (``idembus.awaited``) sends to its reply queue."""

    def __init__(self) -> None:
        self.dead_letters: list[Envelope] = []
        self.sent_back: list[Envelope] = []
        self.failure_replies: list[Envelope] = []

    def send(self, envelope: Envelope) -> None:
        if envelope.message_type == FAILURE_TYPE:
            self.failure_replies.append(envelope)
            return
        (self.dead_letters if envelope.destination == ERROR_QUEUE
         else self.sent_back).append(envelope)

    def publish(self, envelope: Envelope) -> None:
        pass


class Outcomes(Middleware):
    """The outcome of each delivery, as the message stage ends."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def after_message(self, incoming: IncomingMessage, error: BaseException | None) -> None:
        self.seen.append(incoming.outcome)


@dataclass
class Harness:
    endpoint: Endpoint
    transport: RecordingTransport
    outcomes: Outcomes
    paused: SignalCounter
    retried: SignalCounter
    failed: SignalCounter

    def deliver(self, raw: dict[str, str], body: bytes = BODY) -> RecordedDelivery:
        """Deliver a message with ``raw`` headers as every transport does: headers that are
        not UTF-8 text (a lone surrogate) are flagged by ``text_headers`` first."""
        headers, problem = text_headers(raw)
        delivery = RecordedDelivery(QUEUE, headers, body)
        delivery.wire_error = problem
        Transport.deliver(delivery, self.endpoint._processor)
        return delivery


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    transport = RecordingTransport()
    outcomes = Outcomes()
    endpoint = Endpoint(
        QUEUE, transport=transport, storage=MemoryStorage(), handlers=[AccountHandler],
        error_queue=ERROR_QUEUE,
        middleware=[outcomes, Tracing(TracerProvider()),
                    Metrics(MeterProvider(metric_readers=[InMemoryMetricReader()]))],
        recoverability=Recoverability(
            retries=RetryPolicy(immediate_retries=1, delayed=(60.0,)),
            breaker=BreakerPolicy(threshold=1, backoff=Backoff((60.0,))),
            outage_backoff=Backoff((60.0,))))
    # A wait for an outage raises at once (the delivery goes back to the broker) and a
    # pause of the breaker does not block: both are seen, neither hangs the test.
    endpoint.request_stop()
    yield Harness(endpoint, transport, outcomes, SignalCounter(endpoint, "paused"),
                  SignalCounter(endpoint, "retried"), SignalCounter(endpoint, "failed"))


def valid_headers() -> dict[str, str]:
    return {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit",
            h.INTENT: h.Intent.SEND.value}


def assert_handled_or_dead_lettered_at_once(harness: Harness, delivery: RecordedDelivery,
                                            before: tuple[int, int, int, int, int]) -> None:
    """The delivery was settled once, handled or moved to the error queue for its own
    fault: nothing retried, sent back, failed or counted by the breaker."""
    dead, back, paused, retried, failed = before
    assert delivery.acked and not delivery.requeued, "settled as an outage"
    assert harness.outcomes.seen[-1] in ("handled", "discarded", "dead_lettered")
    assert harness.paused.count == paused, "counted by the circuit breaker"
    assert harness.retried.count == retried, "retried"
    assert harness.failed.count == failed, "taken for a failing handler or hook"
    assert len(harness.transport.sent_back) == back, "sent back for a delayed retry"
    if harness.outcomes.seen[-1] == "dead_lettered":
        assert len(harness.transport.dead_letters) == dead + 1
        copy = harness.transport.dead_letters[-1]
        assert copy.headers[h.EXCEPTION_TYPE] in ITS_OWN_FAULT, copy.headers
    else:
        assert len(harness.transport.dead_letters) == dead


def counts(harness: Harness) -> tuple[int, int, int, int, int]:
    return (len(harness.transport.dead_letters), len(harness.transport.sent_back),
            harness.paused.count, harness.retried.count, harness.failed.count)


# -- the regression: digits that are not ASCII ----------------------------------------------


@pytest.mark.parametrize("version", ["²", "①", "٣", "１", " ²", "9" * 5000])
def test_a_version_in_digits_that_are_not_ascii_is_dead_lettered_at_once(
        harness: Harness, version: str) -> None:
    # Before: int("²") raised a ValueError out of the decoder: "failed", a delayed retry
    # and a failure counted by the breaker (here: paused).
    before = counts(harness)
    delivery = harness.deliver({**valid_headers(), h.MESSAGE_VERSION: version})
    assert_handled_or_dead_lettered_at_once(harness, delivery, before)
    assert harness.outcomes.seen[-1] == "dead_lettered"
    copy = harness.transport.dead_letters[-1]
    assert copy.headers[h.EXCEPTION_TYPE] == "idembus.errors.MalformedMessage"
    assert "ASCII digits" in copy.headers[h.EXCEPTION_MESSAGE]


@pytest.mark.parametrize("enclosed", ["test.Deposit:²", "test.Deposit:①",
                                      "test.Other,test.Deposit:²"])
def test_an_enclosed_type_with_a_version_not_in_ascii_digits_is_left_out(
        harness: Harness, enclosed: str) -> None:
    # Before: parse_enclosed's int("²") raised a ValueError: retried, counted, paused.
    before = counts(harness)
    delivery = harness.deliver({**valid_headers(), h.MESSAGE_TYPE: "test.Unknown",
                                h.ENCLOSED_TYPES: enclosed})
    assert_handled_or_dead_lettered_at_once(harness, delivery, before)
    copy = harness.transport.dead_letters[-1]
    assert copy.headers[h.EXCEPTION_TYPE] == "idembus.errors.UnknownMessageType"


def test_ascii_versions_still_decode(harness: Harness) -> None:
    before = counts(harness)
    delivery = harness.deliver({**valid_headers(), h.MESSAGE_VERSION: " 1"})
    assert_handled_or_dead_lettered_at_once(harness, delivery, before)
    assert harness.outcomes.seen[-1] == "handled"
    delivery = harness.deliver({**valid_headers(), h.MESSAGE_TYPE: "test.Unknown",
                                h.ENCLOSED_TYPES: "test.Unknown:2,test.Deposit:1"})
    assert harness.outcomes.seen[-1] == "handled"


def test_whatever_decoding_raises_is_the_messages_fault(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    # A failure no check foresaw (here: the expiry's parser raising something unexpected)
    # is a malformed message, not a hook failure.
    def broken(headers: object) -> None:
        raise OverflowError("date value out of range")

    monkeypatch.setattr("idembus.runtime.processing.expiry_of", broken)
    before = counts(harness)
    delivery = harness.deliver(valid_headers())
    assert_handled_or_dead_lettered_at_once(harness, delivery, before)
    copy = harness.transport.dead_letters[-1]
    assert copy.headers[h.EXCEPTION_TYPE] == "idembus.errors.MalformedMessage"
    assert "OverflowError: date value out of range" in copy.headers[h.EXCEPTION_MESSAGE]


def test_a_deliver_at_the_sender_wrote_does_not_hold_back_the_error_copy(
        harness: Harness) -> None:
    # Found by the property below. Before: the error-queue copy kept the incoming
    # idembus.deliver_at (year 9999), so it was stored as a delayed message due then
    # instead of reaching the error queue.
    before = counts(harness)
    delivery = harness.deliver({**valid_headers(), h.MESSAGE_VERSION: "x",
                                h.DELIVER_AT: "9999-12-31T23:59:59-23:59"})
    assert_handled_or_dead_lettered_at_once(harness, delivery, before)
    assert h.DELIVER_AT not in harness.transport.dead_letters[-1].headers


# -- the property: any value in any idembus header ------------------------------------------

#: Values written to look like what a header holds, and then not quite.
NEAR_MISSES = st.sampled_from([
    "", " ", "0", "-1", "+1", "1.0", "1e3", "0x10", "1_000", "99999999999999999999",
    "9" * 5000, "²", "①", ":²", "test.Deposit:²", "test.Deposit:①,test.Deposit",
    "test.Deposit:0", "test.Deposit:", ",,,", "test.Deposit", "test.Deposit:99999999999",
    "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59", "2026-13-45T99:99:99",
    "２０２６-01-01", "1" * 10000, "nan", "inf", "True", "null", "[]", "{}",
    "00-" + "f" * 32 + "-" + "f" * 16 + "-01", "00-" + "0" * 32 + "-" + "0" * 16 + "-ff",
    "a=b,c=d", "x" * 100_000, "\x00", "line\nbreak", "\u2028", "\ud800",
])
VALUES = st.one_of(
    NEAR_MISSES,
    st.text(max_size=40),
    st.text(alphabet=UNICODE_DIGITS + "0123456789:,-.", max_size=12),
    st.text(alphabet=st.characters(max_codepoint=0x1f) | st.sampled_from("\x7f\x85\u2028"),
            max_size=10),
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.datetimes().map(lambda moment: moment.isoformat()),
)
HEADER_VALUES = st.dictionaries(st.sampled_from(IDEMBUS_HEADERS + TRACE_HEADERS), VALUES,
                                min_size=1, max_size=5)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large, HealthCheck.too_slow])
@given(hostile=HEADER_VALUES)
def test_any_value_in_any_idembus_header_is_handled_or_dead_lettered_never_retried(
        harness: Harness, hostile: dict[str, str]) -> None:
    before = counts(harness)
    delivery = harness.deliver({**valid_headers(), **hostile})
    assert_handled_or_dead_lettered_at_once(harness, delivery, before)


# -- what the log says about such messages --------------------------------------------------

FORGED = "FORGED 2026-11-28 CRITICAL idembus: all accounts emptied"


def formatted_lines(records: list[logging.LogRecord]) -> list[str]:
    """Every record as ``idembus run`` writes it (text, then JSON), traceback included."""
    text, json_lines = TextFormatter(), JsonFormatter()
    return [formatter.format(record) for record in records
            for formatter in (text, json_lines)]


@pytest.mark.parametrize("headers", [
    {h.MESSAGE_ID: f"m-1\n{FORGED}"},
    {h.MESSAGE_ID: f"m-1\r\n{FORGED}", h.MESSAGE_TYPE: f"test.Deposit\n{FORGED}"},
    {h.MESSAGE_TYPE: f"test.Nope\n{FORGED}"},
    {h.MESSAGE_VERSION: f"2\n{FORGED}"},
    {h.DISCARD_AFTER: f"soon\n{FORGED}"},
], ids=["refused id", "id and type", "unknown type", "version", "discard_after"])
def test_no_line_break_of_a_senders_making_starts_a_log_line(
        harness: Harness, caplog: pytest.LogCaptureFixture, headers: dict[str, str]) -> None:
    # Issue 24, finding 9. Before: "moved m-1\nFORGED ... from accounts to accounts-error"
    # put the sender's line in the log as a line of its own.
    caplog.set_level(logging.DEBUG, logger="idembus")
    harness.deliver({**valid_headers(), **headers})
    assert caplog.records
    for line in formatted_lines(caplog.records):
        assert not any(part.startswith(("FORGED", "\rFORGED")) for part in line.splitlines()), line


def test_a_huge_type_name_is_logged_cut_with_its_length(
        harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    # Issue 24, finding 9. Before: the 70 KB name was written whole, in the "moved" line
    # and again in the reason of its traceback.
    caplog.set_level(logging.DEBUG, logger="idembus")
    name = "x" * 70_000
    harness.deliver({**valid_headers(), h.MESSAGE_TYPE: name})
    assert caplog.records
    lines = formatted_lines(caplog.records)
    assert all(len(line) < 12_000 for line in lines), max(map(len, lines))
    assert any("(70000 characters)" in line for line in lines)
    copy = harness.transport.dead_letters[-1]
    assert copy.headers[h.MESSAGE_TYPE] == name  # the copy keeps the message as it came
