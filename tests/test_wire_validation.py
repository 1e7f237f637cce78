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

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.handlers import Handler, handles
from idembus.runtime.recoverability.policy import Recoverability
from idembus.testing import wait_until_idle
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport, _encoding_problem
from idembus.wire import DROPPED_HEADERS, MAX_MESSAGE_ID_LENGTH, problem_with, text_headers
from tests.conftest import foreign_connection
from tests.hostile import plain_amqp
from tests.support import Account, AccountHandler, Deposit, SignalCounter

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


def test_headers_left_out_for_not_being_text_are_named_in_a_header_of_their_own() -> None:
    headers, problem = text_headers({h.MESSAGE_ID: "1", "x-count": 7, "blob": b"\xff",
                                     "flags": [1, 2], "kept": "text"})

    assert problem is None  # none of them is idembus's
    assert headers[DROPPED_HEADERS] == "'x-count' (a int), 'blob' (bytes), 'flags' (a list)"
    assert {name for name in headers if name != DROPPED_HEADERS} == {h.MESSAGE_ID, "kept"}


def test_a_message_that_lost_nothing_has_no_dropped_headers_header() -> None:
    headers, _ = text_headers({h.MESSAGE_ID: "1", "kept": "text"})

    assert DROPPED_HEADERS not in headers


def test_headers_dropped_again_on_a_later_delivery_are_added_to_the_earlier_list() -> None:
    headers, _ = text_headers({DROPPED_HEADERS: "'x-count' (a int)", "x-other": 1.5})

    assert headers[DROPPED_HEADERS] == "'x-count' (a int), 'x-other' (a float)"


def test_the_list_of_dropped_headers_stays_bounded_however_many_and_long_they_are() -> None:
    raw = {f"x-{'n' * 300}-{number}": number for number in range(500)}

    headers, _ = text_headers(raw)

    listed = headers[DROPPED_HEADERS]
    assert len(listed) <= 1000 + len(", … 500 more")
    assert listed.endswith(" more")


def test_a_header_name_that_is_not_utf8_is_listed_as_dropped() -> None:
    headers, _ = text_headers({"bad\udcffname": "value", h.MESSAGE_ID: "1"})

    assert "not UTF-8 text" in headers[DROPPED_HEADERS]
    assert set(headers) == {h.MESSAGE_ID, DROPPED_HEADERS}


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


def test_an_id_of_exactly_the_maximum_length_passes_and_one_character_more_fails() -> None:
    for character in ("i", "é", "😀"):  # characters are counted, not bytes
        longest = _delivery(**{h.MESSAGE_ID: character * MAX_MESSAGE_ID_LENGTH})
        over = _delivery(**{h.MESSAGE_ID: character * (MAX_MESSAGE_ID_LENGTH + 1)})

        assert problem_with(longest, max_message_bytes=1000) is None
        assert f"has {MAX_MESSAGE_ID_LENGTH + 1} characters" in str(
            problem_with(over, max_message_bytes=1000))


def test_a_body_of_exactly_max_message_bytes_passes_and_one_byte_more_fails() -> None:
    assert problem_with(_delivery(b"x" * 100), max_message_bytes=100) is None
    assert problem_with(_delivery(b"x" * 101), max_message_bytes=100) is not None


@pytest.mark.parametrize(("value", "kind"), [
    (42, "a int"), (True, "a bool"), (4.5, "a float"), ({"id": "1"}, "a dict"),
    (["1"], "a list"), (b"1", "bytes"), (None, "empty (void)"),
    ("\udcff\udcfe", "text that is not valid UTF-8"),
])
def test_an_id_that_is_a_number_a_table_a_list_or_bytes_is_refused_as_not_text(
    value: Any, kind: str,
) -> None:
    headers, problem = text_headers({h.MESSAGE_ID: value, h.MESSAGE_TYPE: "test.Deposit"})
    delivery = _Received(queue="q", headers=headers, body=GOOD_BODY, content_type=None,
                         redelivered=False, wire_error=problem)

    assert problem == f"header {h.MESSAGE_ID} is {kind}, not UTF-8 text"
    assert problem_with(delivery, max_message_bytes=1000) == problem


@pytest.mark.parametrize("encoding", [
    None, "", "utf-8", "UTF-8", " utf8 ", "binary", "identity",
])
def test_bodies_that_are_their_own_bytes_have_no_encoding_problem(
    encoding: str | None,
) -> None:
    assert _encoding_problem({}, encoding) is None


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "latin-1", "utf-16", "x-y"])
def test_a_content_encoding_idembus_would_have_to_decode_is_a_problem(encoding: str) -> None:
    problem = _encoding_problem({}, encoding)

    assert problem == f"the content encoding {encoding!r} is not one idembus reads"


@pytest.mark.parametrize("compression", ["application/x-bz2", "gzip", "", 0, b"zlib", None])
def test_any_compression_header_is_a_problem_before_the_encoding_is_looked_at(
    compression: Any,
) -> None:
    problem = _encoding_problem({"compression": compression}, "utf-8")

    assert problem is not None and problem.startswith("the body is compressed")


def test_a_memory_transport_delivers_an_id_that_is_a_number_with_a_wire_error(
    unique: str,
) -> None:
    transport = KombuTransport("memory://")
    queue = f"numbers-{unique}"
    transport.declare(queue)
    with kombu.Connection("memory://") as connection:
        connection.Producer().publish(GOOD_BODY, exchange="", routing_key=queue, declare=[],
                                      headers={h.MESSAGE_ID: 42, "x-count": 3},
                                      content_type="application/json")

    delivery = transport.get(queue)

    assert delivery is not None
    assert delivery.wire_error == f"header {h.MESSAGE_ID} is a int, not UTF-8 text"
    assert delivery.headers[DROPPED_HEADERS] == "'x-count' (a int)"


def test_a_readable_delivery_has_no_problem() -> None:
    delivery = _delivery(**{h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"})

    assert problem_with(delivery, max_message_bytes=len(GOOD_BODY)) is None


# -- through a running endpoint --------------------------------------------------------------


def _publish_raw(transport_url: str, queue: str, body: bytes, headers: dict[Any, Any],
                 **properties: Any) -> None:
    """Publish as a foreign client would: py-amqp on RabbitMQ, kombu's producer elsewhere
    (which compresses the body itself when asked to)."""
    if transport_url.startswith("amqp"):
        import amqp

        with plain_amqp(transport_url) as channel:
            channel.basic_publish(amqp.Message(body, application_headers=headers,
                                               **properties), exchange="", routing_key=queue)
        return
    with foreign_connection(transport_url) as connection:
        compression = "bzip2" if headers.pop("compression", None) else None
        connection.Producer().publish(
            bz2.decompress(body) if compression else body, exchange="", routing_key=queue,
            headers=headers, compression=compression, declare=[],
            content_type=properties.get("content_type", "application/json"),
            content_encoding=properties.get("content_encoding", "utf-8"))


def _valid(**extra: Any) -> dict[Any, Any]:
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
def test_properties_and_header_names_that_are_not_utf8_neither_stop_the_endpoint_nor_vanish(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    if not transport_url.startswith("amqp"):
        pytest.skip("only AMQP carries properties and header names of any bytes")
    # Given a running endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    handled = SignalCounter(accounts, "handled")
    accounts.start()

    # When a client publishes a deposit whose content type, AMQP message id and one header
    # name are bytes that are not UTF-8 (which py-amqp could not read), then one with
    # such a message id only, then a good one
    _publish_raw(transport_url, accounts.name, GOOD_BODY, {**_valid(), b"\xfe": "v"},
                 content_type=b"\xff\xfeapplication/json", message_id=b"\xff")
    _publish_raw(transport_url, accounts.name, GOOD_BODY, _valid(),
                 content_type="application/json", type=b"\xc3", message_id=b"\xff")
    _publish_raw(transport_url, accounts.name, GOOD_BODY, _valid(),
                 content_type="application/json")

    # Then the first is in the error queue with the reason, its content type's bytes as
    # they came, and the header it lost named; the others, whose odd properties idembus
    # does not read, are applied: the endpoint went on
    assert dead_lettered.wait_for(1)
    assert handled.wait_for(2)
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert "content type" in copy.headers[h.EXCEPTION_MESSAGE]
    assert copy.content_type is not None
    assert copy.content_type.encode("utf-8", "surrogateescape") == b"\xff\xfeapplication/json"
    assert copy.headers[DROPPED_HEADERS] == "b'\\xfe' (a name that is not UTF-8 text)"
    assert Account.model_validate(accounts.storage.load("Account", "a").state).balance == 10


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


@pytest.mark.parametrize(("body", "encoding"), [
    (b'{"account": "\xe9", "amount": 5}', "latin-1"),
    ('{"account": "é", "amount": 5}'.encode("utf-16"), "utf-16"),
    (bz2.compress(GOOD_BODY), "gzip"),  # a label that does not match the bytes
    (b"", "utf-16"),  # no body frame at all: py-amqp's body is "" then
])
def test_a_body_in_an_encoding_idembus_does_not_read_reaches_the_error_queue_byte_for_byte(
    make_endpoint: MakeEndpoint, transport_url: str, body: bytes, encoding: str,
) -> None:
    # Given a running endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()

    # When a client sends a deposit whose body is in another encoding than UTF-8
    _publish_raw(transport_url, accounts.name, body, _valid(),
                 content_type="application/json", content_encoding=encoding)

    # Then its copy in the error queue has exactly its bytes (not decoded, not re-encoded)
    assert dead_lettered.wait_for(1)
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert copy.body == body
    assert f"content encoding {encoding!r}" in copy.headers[h.EXCEPTION_MESSAGE]
    assert not accounts.storage.load("Account", "a").exists


def test_the_error_queue_copy_keeps_the_content_encoding_it_arrived_with(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()
    body = b'{"account": "\xe9", "amount": 5}'

    _publish_raw(transport_url, accounts.name, body, _valid(),
                 content_type="application/json", content_encoding="latin-1")

    assert dead_lettered.wait_for(1)
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert (copy.body, copy.content_encoding) == (body, "latin-1")


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16", "gzip", None])
def test_an_envelope_is_published_with_its_content_encoding_and_its_bytes_unchanged(
    make_transport: Callable[..., KombuTransport], queue_name: Callable[[str], str],
    encoding: str | None,
) -> None:
    # Given an envelope holding bytes that are not UTF-8, labelled with their encoding
    transport = make_transport()
    queue = queue_name("encoded")
    transport.declare(queue)
    raw = "é€".encode("utf-16")
    sent = Envelope(headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "x.Y"},
                    body=raw.decode("utf-8", "surrogateescape"), destination=queue,
                    content_type="text/plain", content_encoding=encoding)

    # When it is sent and received
    transport.send(sent)
    received = transport.get(queue)

    # Then the receiver sees the same bytes and the same label (kombu labels bytes without
    # one "binary")
    assert received is not None
    assert received.body == raw
    assert received.content_encoding == (encoding or "binary")


def test_an_envelope_keeps_its_content_encoding_through_its_stored_record() -> None:
    envelope = Envelope(headers={h.MESSAGE_ID: "1"}, body="\udce9", content_encoding="latin-1")
    default = Envelope(headers={h.MESSAGE_ID: "1"}, body="{}")

    assert Envelope.from_record(envelope.to_record()) == envelope
    assert "content_encoding" not in default.to_record()
    assert Envelope.from_record({"headers": {}, "body": ""}).content_encoding == "utf-8"


def test_a_refused_message_tells_in_its_error_copy_which_headers_it_lost(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    # Given a running endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()

    # When a message of a type nobody handles arrives with headers that are not text
    _publish_raw(transport_url, accounts.name, b"{}",
                 _valid(**{h.MESSAGE_TYPE: "nobody.Handles", "x-count": 7,
                           "x-flags": [1, 2]}),
                 content_type="application/json")

    # Then its error-queue copy names them, though it cannot carry them
    assert dead_lettered.wait_for(1)
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert "x-count" not in copy.headers and "x-flags" not in copy.headers
    assert copy.headers[DROPPED_HEADERS] == "'x-count' (a int), 'x-flags' (a list)"


class _FailsFirst(Handler):
    """Fails a deposit's first delivery; records the headers of every delivery."""

    seen: list[dict[str, str]] = []

    @handles
    def deposit(self, message: Deposit) -> None:
        type(self).seen.append(dict(self.context.headers))
        if len(type(self).seen) == 1:
            raise RuntimeError("first delivery fails")


def test_a_delayed_retry_still_names_the_headers_the_message_lost(
    make_endpoint: MakeEndpoint, transport_url: str,
) -> None:
    # Given an endpoint whose handler fails a message once, then retries it after a second
    _FailsFirst.seen = []
    accounts = make_endpoint("accounts", handlers=[_FailsFirst],
                             recoverability=Recoverability(
                                 retries=RetryPolicy(immediate_retries=0, delayed=(1.0,))))
    handled = SignalCounter(accounts, "handled")
    accounts.start()

    # When a deposit arrives with a header that is not text
    _publish_raw(transport_url, accounts.name, GOOD_BODY, _valid(**{"x-count": 7}),
                 content_type="application/json")

    # Then the retried copy, which cannot carry that header, still says it was dropped
    assert handled.wait_for(1)
    first, retried = _FailsFirst.seen
    assert first[DROPPED_HEADERS] == retried[DROPPED_HEADERS] == "'x-count' (a int)"
    assert "x-count" not in retried
