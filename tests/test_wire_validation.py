"""The wire is validated before anything is decoded or stored: headers that are not text,
compressed or otherwise encoded bodies, oversized bodies and unusable message ids send the
message to the error queue with the reason, its bytes forwarded unchanged."""

from __future__ import annotations

import bz2
import uuid
from collections.abc import Callable
from typing import Any

import kombu
import pytest
from hypothesis import given
from hypothesis import strategies as st

from idembus import Endpoint
from idembus import headers as h
from idembus.testing import wait_until_idle
from idembus.transports.base import Delivery
from idembus.wire import MAX_MESSAGE_ID_LENGTH, problem_with, text_headers
from tests.hostile import plain_amqp
from tests.support import Account, AccountHandler, SignalCounter

MakeEndpoint = Callable[..., Endpoint]
GOOD_BODY = b'{"account": "a", "amount": 5}'

# -- text_headers -------------------------------------------------------------------------

_values = st.one_of(
    st.text(), st.binary(), st.integers(), st.booleans(), st.none(), st.floats(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=2),
    st.text().map(lambda text: text + "\ud800"),  # what py-amqp makes of encoded surrogates
)


@given(st.dictionaries(st.one_of(st.text(max_size=20), st.sampled_from(
    [h.MESSAGE_ID, h.MESSAGE_TYPE, h.CORRELATION_ID, "x-custom"])), _values, max_size=6))
def test_text_headers_keep_only_text_and_flag_every_idembus_header_that_is_not(
    raw: dict[str, Any],
) -> None:
    headers, problem = text_headers(raw)

    assert all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
    for value in headers.values():
        value.encode("utf-8")  # never a lone surrogate
    not_text = [name for name, value in raw.items() if name.startswith("idembus.")
                and not (isinstance(value, str) and _utf8(value))]
    if not_text:
        assert problem is not None
        assert all(name in problem for name in not_text)
    else:
        assert problem is None
    for name, value in raw.items():
        if isinstance(value, str) and _utf8(value):
            assert headers[name] == value  # text is kept exactly


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def test_two_different_undecodable_ids_are_never_made_one() -> None:
    first, _ = text_headers({h.MESSAGE_ID: b"\xff\x01"})
    second, _ = text_headers({h.MESSAGE_ID: b"\xff\x02"})

    assert first[h.MESSAGE_ID] != second[h.MESSAGE_ID]


class _Received(Delivery):
    def _ack(self) -> None: ...

    def _requeue(self) -> None: ...


def _delivery(body: bytes = GOOD_BODY, **headers: str) -> Delivery:
    return _Received(queue="q", headers=headers, body=body, content_type=None,
                     redelivered=False)


@pytest.mark.parametrize(("delivery", "mentions"), [
    (_delivery(b"x" * 101), "exceeds max_message_bytes=100"),
    (_delivery(**{h.MESSAGE_ID: "i" * (MAX_MESSAGE_ID_LENGTH + 1)}), "at most 200"),
    (_delivery(**{h.MESSAGE_ID: "abc\x00def"}), "control characters"),
    (_delivery(**{h.MESSAGE_ID: "abc\ndef"}), "control characters"),
])
def test_problem_with_names_what_is_wrong_before_decoding(delivery: Delivery,
                                                         mentions: str) -> None:
    problem = problem_with(delivery, max_message_bytes=100)

    assert problem is not None and mentions in problem


def test_a_readable_delivery_has_no_problem() -> None:
    delivery = _delivery(**{h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"})

    assert problem_with(delivery, max_message_bytes=len(GOOD_BODY)) is None


# -- through a running endpoint --------------------------------------------------------------


def _publish_raw(transport_url: str, queue: str, body: bytes, headers: dict[str, Any],
                 **properties: Any) -> None:
    """Publish as a foreign client would: py-amqp on RabbitMQ, kombu's producer elsewhere
    (which compresses the body itself when asked to)."""
    if transport_url.startswith("amqp"):
        import amqp

        with plain_amqp(transport_url) as channel:
            channel.basic_publish(amqp.Message(body, application_headers=headers,
                                               **properties), exchange="", routing_key=queue)
        return
    with kombu.Connection(transport_url) as connection:
        compression = "bzip2" if headers.pop("compression", None) else None
        connection.Producer().publish(
            bz2.decompress(body) if compression else body, exchange="", routing_key=queue,
            headers=headers, compression=compression, declare=[],
            content_type=properties.get("content_type", "application/json"),
            content_encoding=properties.get("content_encoding", "utf-8"))


def _valid(**extra: Any) -> dict[str, Any]:
    return {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit", **extra}


def test_a_compressed_message_goes_to_the_error_queue_still_compressed(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    # Given a running endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()
    compressed = bz2.compress(GOOD_BODY)

    # When a client sends a bz2-compressed deposit
    _publish_raw(transport_url, accounts.name, compressed,
                 _valid(compression="application/x-bz2"))

    # Then it is refused unread: in the error queue with the reason, bytes unchanged
    assert dead_lettered.wait_for(1)
    wait_until_idle([accounts])
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert copy.body == compressed
    assert "compressed" in copy.headers[h.EXCEPTION_MESSAGE]
    assert not accounts.storage.load("Account", "a").exists


@pytest.mark.amqp
def test_headers_that_are_not_text_are_refused_and_two_undecodable_ids_stay_two(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    if not transport_url.startswith("amqp"):
        pytest.skip("only AMQP carries header values of every type")
    # Given a running endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    handled = SignalCounter(accounts, "handled")
    accounts.start()

    # When deposits arrive with ids that are not UTF-8 text, a number, a table, a
    # gzip-encoded body, and then a good one
    odd = [_valid(**{h.MESSAGE_ID: b"\xff\x01"}), _valid(**{h.MESSAGE_ID: b"\xff\x02"}),
           _valid(**{h.MESSAGE_ID: b"\xed\xa0\x80"}), _valid(**{h.MESSAGE_ID: 42}),
           _valid(**{h.MESSAGE_TYPE: {"type": "test.Deposit"}})]
    for headers in odd:
        _publish_raw(transport_url, accounts.name, GOOD_BODY, headers,
                     content_type="application/json")
    _publish_raw(transport_url, accounts.name, GOOD_BODY, _valid(),
                 content_type="application/json", content_encoding="gzip")
    _publish_raw(transport_url, accounts.name, GOOD_BODY, _valid(),
                 content_type="application/json")

    # Then each odd one is in the error queue with its reason, none counted a duplicate,
    # and only the good one was applied
    assert dead_lettered.wait_for(len(odd) + 1)
    assert handled.wait_for(1)
    wait_until_idle([accounts])
    reasons = []
    while (copy := accounts.transport.get(accounts.error_queue)) is not None:
        reasons.append(copy.headers[h.EXCEPTION_MESSAGE])
    assert len(reasons) == len(odd) + 1
    assert sum("not UTF-8 text" in reason for reason in reasons) == len(odd)
    assert sum("content encoding" in reason for reason in reasons) == 1
    assert accounts.counters["duplicate"] == 0
    assert Account.model_validate(accounts.storage.load("Account", "a").state).balance == 5


def test_a_body_over_max_message_bytes_is_refused_unread(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    accounts = make_endpoint("accounts", handlers=[AccountHandler], max_message_bytes=64)
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()
    padded = b'{"account": "a", "amount": 5, "pad": "' + b"x" * 100 + b'"}'

    _publish_raw(transport_url, accounts.name, padded, _valid(),
                 content_type="application/json")

    assert dead_lettered.wait_for(1)
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert copy.body == padded
    assert "exceeds max_message_bytes=64" in copy.headers[h.EXCEPTION_MESSAGE]
