"""Bad input (DESIGN §2, row "malformed body, unknown type, schema-invalid").

Requirement: a malformed body, an unknown type, a schema-invalid body or a missing message
id goes to the error queue with the reason in its headers, is counted, and the endpoint
keeps consuming. Nothing is lost and nothing crashes.

Bad messages are put straight on the endpoint's queue: with the transport where idembus
can express them, with raw kombu where it cannot (another content type, bytes that are
not UTF-8).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from idembus import Endpoint
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.testing import wait_until_idle
from tests.conftest import foreign_connection
from tests.support import Account, AccountHandler, Deposit, SignalCounter

MakeEndpoint = Callable[..., Endpoint]

#: Header naming the case, so that each error-queue copy can be told apart.
CASE = "test.case"


@dataclass(frozen=True)
class BadInput:
    """One bad message and what its error-queue copy must say."""

    case: str
    body: bytes
    exception: str
    reason_mentions: tuple[str, ...]
    headers: dict[str, str] = field(default_factory=dict)
    #: Sent with raw kombu under this content type; ``None``: sent with the transport.
    raw_content_type: str | None = None


def _valid_headers(message_type: str = "test.Deposit") -> dict[str, str]:
    return {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: message_type}


def bad_inputs() -> list[BadInput]:
    good_body = b'{"account": "a", "amount": 5}'
    return [
        BadInput("body is not JSON", b"{not json", "idembus.errors.MalformedMessage",
                 ("JSON",), _valid_headers()),
        BadInput("required field missing", b'{"account": "a"}', "idembus.errors.InvalidMessage",
                 ("test.Deposit", "amount", "required"), _valid_headers()),
        BadInput("field of the wrong type", b'{"account": "a", "amount": "lots"}',
                 "idembus.errors.InvalidMessage", ("test.Deposit", "amount"), _valid_headers()),
        BadInput("JSON but not an object", b"[1, 2]", "idembus.errors.InvalidMessage",
                 ("test.Deposit",), _valid_headers()),
        BadInput("unknown message type", good_body, "idembus.errors.UnknownMessageType",
                 ("test.NoSuchType", "test.Deposit"), _valid_headers("test.NoSuchType")),
        BadInput("message id header missing", good_body, "idembus.errors.MalformedMessage",
                 (h.MESSAGE_ID, "missing"), {h.MESSAGE_TYPE: "test.Deposit"}),
        BadInput("type header missing", good_body, "idembus.errors.MalformedMessage",
                 (h.MESSAGE_TYPE, "missing"), {h.MESSAGE_ID: str(uuid.uuid4())}),
        BadInput("content type text/plain", b"deposit 5 on a", "idembus.errors.MalformedMessage",
                 ("text/plain", "application/json"), _valid_headers(),
                 raw_content_type="text/plain"),
        BadInput("body is not UTF-8", b"\xff\xfe", "idembus.errors.MalformedMessage",
                 ("JSON",), _valid_headers(), raw_content_type="application/json"),
    ]


def put_on_queue(endpoint: Endpoint, transport_url: str, bad: BadInput) -> None:
    headers = {**bad.headers, CASE: bad.case}
    if bad.raw_content_type is None:
        endpoint.transport.send(Envelope(
            headers=headers, body=bad.body.decode("utf-8"), destination=endpoint.name
        ))
        return
    with foreign_connection(transport_url) as connection:
        connection.Producer().publish(
            bad.body, exchange="", routing_key=endpoint.name, headers=headers,
            content_type=bad.raw_content_type, declare=[],
        )


def drain(endpoint: Endpoint, queue: str) -> list[tuple[dict[str, str], bytes]]:
    taken = []
    while (delivery := endpoint.transport.get(queue)) is not None:
        taken.append((dict(delivery.headers), delivery.body))
    return taken


def test_bad_input_goes_to_the_error_queue_with_its_reason_and_the_endpoint_keeps_consuming(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    # Given a running accounts endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    handled = SignalCounter(accounts, "handled")
    failed = SignalCounter(accounts, "failed")
    accounts.start()
    cases = bad_inputs()

    # When every kind of bad message arrives on its queue
    for bad in cases:
        put_on_queue(accounts, transport_url, bad)
    assert dead_lettered.wait_for(len(cases)), f"dead-lettered only {dead_lettered.count}"
    # ... and then a good one
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then the good one is processed: the endpoint kept consuming
    assert handled.wait_for(1)
    wait_until_idle([accounts])
    assert accounts.running
    record = accounts.storage.load("Account", "a")
    assert Account.model_validate(record.state) == Account(balance=5, deposits=1)

    # And each bad one is in the error queue exactly once, unchanged, with its reason
    copies = drain(accounts, accounts.error_queue)
    by_case: dict[str, list[tuple[dict[str, str], bytes]]] = {}
    for headers, body in copies:
        by_case.setdefault(headers.get(CASE, "?"), []).append((headers, body))
    assert sorted(by_case) == sorted(bad.case for bad in cases)
    for bad in cases:
        [(headers, body)] = by_case[bad.case]
        assert body == bad.body, bad.case
        for name, value in bad.headers.items():
            assert headers.get(name) == value, (bad.case, name)
        assert headers[h.EXCEPTION_TYPE] == bad.exception, bad.case
        reason = headers[h.EXCEPTION_MESSAGE]
        for mention in bad.reason_mentions:
            assert mention in reason, (bad.case, reason)
        assert headers[h.FAILED_QUEUE] == accounts.name, bad.case
        assert headers[h.IMMEDIATE_ATTEMPTS] == "0", bad.case
        assert headers[h.TIME_OF_FAILURE], bad.case
        assert headers[h.STACK_TRACE], bad.case

    # And nothing was retried, nothing lost, and every failure was counted
    assert failed.count == 0
    assert accounts.counters["retried"] == 0
    assert accounts.counters["dead_lettered"] == len(cases)
    assert accounts.counters["received"] == len(cases) + 1
    assert len(copies) + handled.count == len(cases) + 1
    assert accounts.transport.pending(accounts.name) == 0


def test_a_good_message_between_bad_ones_is_processed_and_the_bad_ones_are_not_retried(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    # Given a running accounts endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    handled = SignalCounter(accounts, "handled")
    accounts.start()
    not_json, *_, not_utf8 = bad_inputs()

    # When bad, good and bad messages arrive in a row, and the good one again
    put_on_queue(accounts, transport_url, not_json)
    deposit_id = accounts.bus.send(Deposit(account="a", amount=5))
    put_on_queue(accounts, transport_url, not_utf8)
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then the good one is applied once and each bad one is dead-lettered once
    assert dead_lettered.wait_for(2)
    assert handled.wait_for(1)
    wait_until_idle([accounts])
    assert accounts.counters["duplicate"] == 1
    record = accounts.storage.load("Account", "a")
    assert Account.model_validate(record.state) == Account(balance=5, deposits=1)
    copies = drain(accounts, accounts.error_queue)
    assert sorted(headers[CASE] for headers, _ in copies) == sorted(
        [not_json.case, not_utf8.case]
    )
    assert accounts.counters["failed"] == 0


def test_the_error_queue_copy_keeps_the_original_content_type(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    # Given a running endpoint and a message labelled text/plain
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()
    plain = next(bad for bad in bad_inputs() if bad.raw_content_type == "text/plain")

    # When it is dead-lettered
    put_on_queue(accounts, transport_url, plain)
    assert dead_lettered.wait_for(1)

    # Then its copy still says text/plain, so a replay meets the same content
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert copy.content_type == "text/plain"
    assert copy.body == plain.body


def test_a_json_content_type_with_a_charset_parameter_is_processed(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    # Given a running endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    handled = SignalCounter(accounts, "handled")
    accounts.start()

    # When a client labels its JSON "application/json; charset=utf-8"
    with foreign_connection(transport_url) as connection:
        connection.Producer().publish(
            b'{"account": "a", "amount": 7}', exchange="", routing_key=accounts.name,
            headers=_valid_headers(), content_type="application/json; charset=utf-8",
            declare=[],
        )

    # Then it is handled like any other
    assert handled.wait_for(1)
    assert accounts.counters["dead_lettered"] == 0
    record = accounts.storage.load("Account", "a")
    assert Account.model_validate(record.state).balance == 7
