"""A hostile client with publish rights, for ``tests/test_hostile_input.py``.

Messages are published with py-amqp itself (not idembus, not kombu's producer), so that
nothing helps them: header names and values of any AMQP type, keys given twice, bodies of
any bytes, any content type and encoding, any message properties. :class:`Model` is the
specification of what a running endpoint must do with each one, written from README's
"Wire format" and the guarantee, not from the code; :func:`publish_refusal` says which
messages the client library or the broker refuses before an endpoint could see them.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import math
import os
import re
import struct
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import amqp
import amqp.exceptions
import pydantic
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from idembus import Command
from idembus import headers as h
from idembus.handlers import Handler, handles
from idembus.wire import DEFAULT_MAX_MESSAGE_BYTES, DROPPED_HEADERS, MAX_MESSAGE_ID_LENGTH
from tests.support import Deposit

#: Examples of the generated hostile traffic (reduced in ``make test``).
EXAMPLES = int(os.environ.get("IDEMBUS_HOSTILE_EXAMPLES", "25"))
#: Hypothesis settings of a suite sending hostile traffic to a live endpoint. Shrinking
#: would replay against it, each failing replay waiting for its sentinel: a failing example
#: is reported as generated instead.
LIVE_ENDPOINT = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                         phases=[Phase.explicit, Phase.reuse, Phase.generate],
                         suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                HealthCheck.too_slow,
                                                HealthCheck.data_too_large])
#: Header carrying the test's own sequence number (plain text), to match error-queue copies.
SEQUENCE = "test.sequence"
#: An account name PostgreSQL cannot index (a btree row holds at most ~2,700 bytes, after
#: compression: so 6,400 bytes that do not compress, the same in every run).
LONG_ACCOUNT = "".join(hashlib.sha256(str(n).encode()).hexdigest() for n in range(100))
#: Accounts the generated deposits go to: few, so that ids and aggregates collide.
ACCOUNTS = ("a", "b", "nul\x00inside", LONG_ACCOUNT)
#: Message ids drawn from a small pool, so that duplicates happen.
ID_POOL = tuple(str(uuid.UUID(int=n)) for n in range(1, 6))
#: AMQP's short strings (header names, most message properties) hold at most this many bytes.
SHORTSTR_BYTES = 255
#: Content encodings of a body that is its own bytes (README, "What the wire accepts").
PLAIN_ENCODINGS = ("", "identity", "utf-8", "utf8", "binary")


class _Table(dict):  # type: ignore[type-arg]
    """A header table that writes every pair it was given, keys given twice included
    (py-amqp writes a table from ``items()``); a reader keeps the last of each."""

    def __init__(self, pairs: Iterable[tuple[str, Any]]) -> None:
        self._pairs = list(pairs)
        super().__init__(self._pairs)

    def items(self) -> Any:
        return list(self._pairs)


@dataclass
class WireMessage:
    """One message exactly as the hostile client puts it on the wire: ``earlier`` are
    header pairs written before ``headers`` in the same table (the same names given twice:
    the later value is the one a reader sees)."""

    headers: dict[Any, Any]
    body: bytes
    content_type: str | bytes | None = "application/json"
    content_encoding: str | bytes | None = None
    sequence: int = 0
    #: Other AMQP properties: ``message_id``, ``type``, ``priority``, ``expiration``. Short
    #: strings (these, the content type and encoding) may be bytes that are not UTF-8.
    extra: dict[str, Any] = field(default_factory=dict)
    earlier: list[tuple[Any, Any]] = field(default_factory=list)

    def properties(self) -> dict[str, Any]:
        pairs = [*self.earlier, *self.headers.items(), (SEQUENCE, str(self.sequence))]
        found: dict[str, Any] = {"application_headers": _Table(pairs) if self.earlier
                                 else dict(pairs), **self.extra}
        if self.content_type is not None:
            found["content_type"] = self.content_type
        if self.content_encoding is not None:
            found["content_encoding"] = self.content_encoding
        return found


@contextmanager
def plain_amqp(url: str) -> Iterator[amqp.Channel]:
    """A py-amqp channel on the broker of ``url`` (an amqp:// URL, vhost included)."""
    parsed = urllib.parse.urlparse(url)
    vhost = urllib.parse.unquote(parsed.path[1:]) if parsed.path not in ("", "/") else "/"
    connection = amqp.Connection(
        host=f"{parsed.hostname or '127.0.0.1'}:{parsed.port or 5672}",
        userid=urllib.parse.unquote(parsed.username or "guest"),
        password=urllib.parse.unquote(parsed.password or "guest"),
        virtual_host=vhost or "/",
        # basic_publish waits for the broker's confirm, or for its refusal: without this
        # py-amqp returns at once and a refused publish went unnoticed.
        confirm_publish=True)
    connection.connect()
    try:
        channel = connection.channel()
        channel.auto_decode = False  # bodies stay bytes
        yield channel
    finally:
        connection.close()


def publish(channel: amqp.Channel, queue: str, message: WireMessage) -> None:
    """Put ``message`` on ``queue`` through the default exchange, confirmed."""
    channel.basic_publish(amqp.Message(message.body, **message.properties()),
                          exchange="", routing_key=queue)


class Ping(Command, message_name="test.Ping"):
    """Answered with a Pong to its ``idembus.reply_to``: replies to where a hostile client
    says."""

    note: str = ""


class Pong(Command, message_name="test.Pong"):
    note: str = ""


class Pinger(Handler):
    """Replies to every Ping."""

    @handles
    def ping(self, message: Ping) -> None:
        self.bus.reply(Pong(note=message.note))


# -- what the client library and the broker refuse ----------------------------------------


@dataclass(frozen=True)
class PublishRefusal:
    """Why a message never reaches the endpoint, and what its publish raises."""

    reason: str
    raises: tuple[type[BaseException], ...]


#: py-amqp cannot encode it (a number or a length beyond its field).
_UNENCODABLE = (struct.error,)
#: RabbitMQ closes the channel or the connection.
_BROKER_REFUSES = (amqp.exceptions.PreconditionFailed, amqp.exceptions.InternalError)


def publish_refusal(message: WireMessage) -> PublishRefusal | None:
    """What refuses ``message`` before an endpoint could see it, or ``None``: a header
    name or short-string property over 255 bytes, an integer beyond 64 bits, a priority
    beyond an octet (py-amqp cannot write them); a float that is not finite (RabbitMQ's
    INTERNAL_ERROR) or an expiration that is not a whole number of milliseconds
    (PRECONDITION_FAILED)."""
    table = [*message.earlier, *message.headers.items()]
    names = [name for name, _ in table] + [name for _, value in table
                                           for name in _nested_names(value)]
    if any(_bytes(name) > SHORTSTR_BYTES for name in names):
        return PublishRefusal("a header name over 255 bytes", _UNENCODABLE)
    shorts = [message.extra.get("message_id"), message.extra.get("type"),
              message.content_type, message.content_encoding]
    if any(text is not None and _bytes(text) > SHORTSTR_BYTES for text in shorts):
        return PublishRefusal("a property over 255 bytes", _UNENCODABLE)
    values = [leaf for _, value in table for leaf in _leaves(value)]
    if any(isinstance(v, int) and not -2**63 <= v < 2**63 for v in values):
        return PublishRefusal("an integer beyond 64 bits", _UNENCODABLE)
    if not 0 <= message.extra.get("priority", 0) <= 255:
        return PublishRefusal("a priority beyond an octet", _UNENCODABLE)
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        return PublishRefusal("a float that is not finite", _BROKER_REFUSES)
    expiration = message.extra.get("expiration")
    if expiration is not None and not re.fullmatch(r"[0-9]{1,9}", expiration):
        return PublishRefusal("an expiration that is not milliseconds", _BROKER_REFUSES)
    return None


def _bytes(text: str | bytes) -> int:
    return len(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _nested_names(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for name, item in value.items():
            yield name
            yield from _nested_names(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _nested_names(item)


# -- what the endpoint must do ------------------------------------------------------------


def received_value(value: Any) -> Any:
    """What a value looks like to the consumer: AMQP carries bytes and text alike as a
    long string, which py-amqp reads back as text when it can."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return value
    return value


def is_text(value: Any) -> bool:
    """A ``str`` that is valid UTF-8 (lone surrogates are not)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: not UTF-8 on the wire
        return False
    return True


#: What the error-queue copy's ``idembus.exception.message`` says for each kind of refusal
#: (``storage refuses`` is told by its ``idembus.exception.type``).
REASONS = {
    "not text": r"header idembus\..* is .*not UTF-8 text",
    "compressed": r"the body is compressed",
    "encoded": r"the content encoding .* is not one idembus reads",
    "too large": r"the body of \d+ bytes exceeds max_message_bytes",
    "bad id": (rf"the {re.escape(h.MESSAGE_ID)} header (has \d+ characters; at most "
               rf"{MAX_MESSAGE_ID_LENGTH}|.* has control characters)"),
    "content type": r"content type .* is not application/json",
    "no id": rf"the {re.escape(h.MESSAGE_ID)} header is missing",
    "no type": rf"the {re.escape(h.MESSAGE_TYPE)} header is missing",
    "unknown type": r"unknown message type",
    "invalid body": r"the body (is not valid JSON|does not match test\.Deposit)",
}


#: The AMQP properties that stand for a core header the headers table lacks (the wire
#: format; the table wins where both are present).
PROPERTY_HEADERS = (("message_id", h.MESSAGE_ID), ("type", h.MESSAGE_TYPE))


def received_headers(message: WireMessage) -> dict[str, Any]:
    """The headers as the endpoint receives them: the last value of a name given twice,
    and the core headers the table lacks taken from their AMQP properties."""
    headers = {name: received_value(value)
               for name, value in [*message.earlier, *message.headers.items()]}
    for name, header in PROPERTY_HEADERS:
        if header not in headers and message.extra.get(name) is not None:
            headers[header] = received_value(message.extra[name])
    return headers


def wire_reasons(message: WireMessage) -> list[str]:
    """Every reason (a key of :data:`REASONS`) the endpoint has to refuse ``message``
    before handling it; the error copy must state one of them."""
    headers = received_headers(message)
    reasons = []
    if any(name.startswith("idembus.") and not is_text(value)
           for name, value in headers.items() if is_text(name)):
        reasons.append("not text")
    if "compression" in headers:
        reasons.append("compressed")
    encoding = received_value(message.content_encoding or "")
    if not is_text(encoding) or encoding.strip().lower() not in PLAIN_ENCODINGS:
        reasons.append("encoded")
    if len(message.body) > DEFAULT_MAX_MESSAGE_BYTES:
        reasons.append("too large")
    message_id = headers.get(h.MESSAGE_ID)
    if not message_id:
        reasons.append("no id")
    elif is_text(message_id) and (len(message_id) > MAX_MESSAGE_ID_LENGTH or any(
            ord(c) < 32 or ord(c) == 127 for c in message_id)):
        reasons.append("bad id")
    message_type = headers.get(h.MESSAGE_TYPE)
    if not message_type:
        reasons.append("no type")
    elif message_type != "test.Deposit":
        reasons.append("unknown type")
    content_type = received_value(message.content_type or "")
    if not is_text(content_type) or content_type.split(";", 1)[0].strip().lower() not in (
            "", "application/json"):
        reasons.append("content type")
    try:
        Deposit.model_validate_json(message.body)
    except pydantic.ValidationError:
        reasons.append("invalid body")
    return reasons


def dropped_names(message: WireMessage) -> list[str]:
    """The headers the endpoint receives but cannot keep (not text, and not idembus's):
    named in the copies' :data:`~idembus.wire.DROPPED_HEADERS` header."""
    return [name for name, value in received_headers(message).items()
            if name != "x-delivery-count" and not (
                is_text(name) and (is_text(value) or name.startswith("idembus.")))]


def names_dropped(copy_headers: dict[str, Any], names: list[str]) -> bool:
    """Whether an error copy's headers list every one of ``names`` as dropped (or says
    that the list was cut), and carries none of them."""
    listed = copy_headers.get(DROPPED_HEADERS, "")
    if any(name in copy_headers for name in names):
        return False
    return all(repr(name) in listed for name in names) or listed.endswith(" more")


def storage_refuses(deposit: Deposit) -> bool:
    """PostgreSQL cannot store a NUL character, nor index a 3,000-byte key."""
    return "\x00" in deposit.account or len(deposit.account.encode()) > 2000


@dataclass
class Model:
    """What the endpoint's effects must be after the messages so far."""

    applied: set[tuple[str, str]] = field(default_factory=set)
    balances: dict[str, int] = field(default_factory=dict)
    #: The reasons each refused message may be refused for, by sequence number.
    refused: dict[int, list[str]] = field(default_factory=dict)

    def expect(self, message: WireMessage) -> str:
        """``applied``, ``duplicate`` or ``refused`` (the error queue, with a reason)."""
        reasons = wire_reasons(message)
        if not reasons:
            deposit = Deposit.model_validate_json(message.body)
            if storage_refuses(deposit):
                reasons = ["storage refuses"]
        if reasons:
            self.refused[message.sequence] = reasons
            return "refused"
        message_id = str(received_headers(message)[h.MESSAGE_ID])
        key = (deposit.account, message_id)
        if key in self.applied:
            return "duplicate"
        self.applied.add(key)
        self.balances[deposit.account] = self.balances.get(deposit.account, 0) + deposit.amount
        return "applied"


def assert_handled(model: Model, copies: dict[int, Any], sent: dict[int, WireMessage],
                   stored: dict[str, dict[str, Any]]) -> None:
    """The invariants once an endpoint handled everything ``sent`` (by sequence number):
    ``copies`` (error-queue deliveries, by sequence number) are the refused messages and
    nothing else, each with a reason of the kind expected, its body unchanged and the
    headers it could not carry named; every other message was applied exactly once (or was
    a duplicate of one that was): the ``stored`` accounts have the model's balances."""
    refused = {sequence for sequence in sent if sequence in model.refused}
    assert set(copies) == refused, {
        "missing": {s: model.refused[s] for s in refused - set(copies)},
        "unexpected": {s: copies[s].headers.get(h.EXCEPTION_MESSAGE)
                       for s in set(copies) - refused},
    }
    for sequence, copy in copies.items():
        expected = model.refused[sequence]
        assert states_a_reason(dict(copy.headers), expected), (
            sequence, expected, copy.headers.get(h.EXCEPTION_TYPE),
            copy.headers.get(h.EXCEPTION_MESSAGE))
        assert copy.body == sent[sequence].body, sequence
        lost = dropped_names(sent[sequence])
        assert names_dropped(dict(copy.headers), lost), (sequence, lost, copy.headers)
    for account, balance in model.balances.items():
        assert stored.get(account, {}).get("balance") == balance, account


def states_a_reason(copy_headers: dict[str, Any], reasons: list[str]) -> bool:
    """Whether an error copy's failure headers state one of ``reasons``."""
    said = str(copy_headers.get(h.EXCEPTION_MESSAGE, ""))
    if "storage refuses" in reasons:
        return "StorageRefused" in str(copy_headers.get(h.EXCEPTION_TYPE, ""))
    return any(re.search(REASONS[reason], said, re.DOTALL) for reason in reasons)


# -- hostile messages ---------------------------------------------------------------------


def _weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``choices``, drawn in proportion to its weight (``st.one_of`` flattens the
    alternatives of nested ``one_of`` into one list, so weights there drift)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda index: table[index])


_odd_values = st.one_of(
    st.integers(-2**31, 2**31 - 1), st.integers(-2**64, 2**64), st.booleans(), st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.binary(max_size=20).filter(lambda b: isinstance(received_value(b), bytes)),
    st.just(b"\xed\xa0\x80"),  # an encoded lone surrogate: py-amqp gives a str back
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    st.lists(st.integers(0, 9), max_size=3),
)
#: Rarely: what py-amqp cannot write or RabbitMQ cannot hold.
_unpublishable = st.sampled_from([float("nan"), float("inf"), [float("-inf")], 2**64,
                                  {"n": -(2**63) - 1}])
_text = st.text(max_size=30)


def _deposit_body(account: str, amount: Any, padding: int = 0) -> bytes:
    fields: dict[str, Any] = {"account": account, "amount": amount}
    if padding:
        fields["pad"] = "p" * padding
    return json.dumps(fields).encode()


_good_bodies = st.builds(_deposit_body, st.sampled_from(ACCOUNTS[:2]), st.integers(1, 100),
                         st.sampled_from([0, 0, 0, 100, 4096]))
_bodies = st.one_of(
    st.builds(_deposit_body, st.sampled_from(ACCOUNTS), st.integers(1, 100)),
    st.builds(_deposit_body, st.sampled_from(ACCOUNTS[:2]), st.integers(1, 100),
              st.integers(0, 4096)),
    st.builds(_deposit_body, st.sampled_from(ACCOUNTS[:2]), st.sampled_from(["lots", [1]])),
    st.binary(max_size=4096),
    st.just(b"{not json"),
    st.just(b"\xff\xfe\x00"),
    st.builds(lambda account: bz2.compress(_deposit_body(account, 3)),
              st.sampled_from(ACCOUNTS[:2])),
    st.builds(lambda account: _deposit_body(account, 4).decode().encode("utf-16"),
              st.sampled_from(ACCOUNTS[:2])),
    st.builds(lambda account: _deposit_body(account, 5).replace(b'"}', b'\xe9"}'),
              st.sampled_from(ACCOUNTS[:2])),  # latin-1
)

#: Ids of every length up to well past the limit, and at the limit.
_lengths = st.one_of(st.sampled_from(range(MAX_MESSAGE_ID_LENGTH + 101)),
                     st.sampled_from([MAX_MESSAGE_ID_LENGTH - 1, MAX_MESSAGE_ID_LENGTH,
                                      MAX_MESSAGE_ID_LENGTH + 1]))
_ids = _weighted(
    (3, st.sampled_from(ID_POOL)), (1, st.just(None)), (1, st.just("")), (1, _odd_values),
    (1, _text), (3, st.builds(lambda n: "i" * n, _lengths)),
    (3, st.builds(lambda n, seed: hashlib.sha256(seed).hexdigest()[:n].ljust(n, "é"),
                  _lengths, st.binary(min_size=1, max_size=4))),
    (1, st.text(min_size=MAX_MESSAGE_ID_LENGTH - 2, max_size=MAX_MESSAGE_ID_LENGTH + 2)),
    (1, st.builds(lambda i: i + "\x00", st.sampled_from(ID_POOL))),
    (1, st.builds(lambda i: i.encode(), st.sampled_from(ID_POOL))),
)
#: Header names: idembus's and others, random ones of any length and script (some over
#: AMQP's 255 bytes), and ``idembus.``-prefixed ones nobody defined.
_names = _weighted(
    (4, st.sampled_from([h.CORRELATION_ID, h.TIME_SENT, h.REPLY_TO, "x-custom", "compression",
                         "priority"])),
    (4, st.text(min_size=1, max_size=40)),
    (1, st.text(min_size=1, max_size=300)),
    (1, st.builds(lambda text: "idembus." + text, st.text(max_size=20))),
)


#: Values of other headers: mostly text; rarely what RabbitMQ cannot hold.
_header_values = _weighted((6, _text), (2, st.text(max_size=300)), (3, _odd_values),
                           (1, st.integers(0, 9).flatmap(
                               lambda pick: _unpublishable if pick == 0 else _odd_values)))


@st.composite
def wire_messages(draw: st.DrawFn) -> WireMessage:
    """A message as a hostile or careless client would publish it: mostly good deposits
    (so that duplicates and effects happen), and every way of being wrong."""
    headers: dict[str, Any] = {}
    earlier: list[tuple[str, Any]] = []
    message_id = draw(_weighted((3, st.sampled_from(ID_POOL)), (2, _ids)))
    if message_id is not None:
        if draw(st.integers(0, 9)) == 0:  # the id given twice in one table
            earlier.append((h.MESSAGE_ID, draw(_ids)))
        headers[h.MESSAGE_ID] = message_id
    message_type = draw(_weighted((12, st.just("test.Deposit")), (1, st.just(None)),
                                  (1, _text), (1, _odd_values)))
    if message_type is not None:
        headers[h.MESSAGE_TYPE] = message_type
    count = draw(st.sampled_from([0, 1, 2, 3, 3, 24]))
    for name in draw(st.lists(_names, max_size=count, unique=True)):
        if name not in headers and name != SEQUENCE:
            headers[name] = draw(_header_values)
    extra: dict[str, Any] = {}
    if draw(st.booleans()):
        extra["message_id"] = draw(st.one_of(
            st.sampled_from(ID_POOL), st.text(max_size=300), st.binary(max_size=8),
            st.builds(lambda n: "m" * n, st.sampled_from([SHORTSTR_BYTES, SHORTSTR_BYTES + 1]))))
    if draw(st.booleans()):
        extra["type"] = draw(st.one_of(st.just("test.Deposit"), _text, st.binary(max_size=8)))
    if draw(st.integers(0, 7)) == 0:
        extra["priority"] = draw(st.integers(0, 256))
    if draw(st.integers(0, 7)) == 0:
        extra["expiration"] = draw(st.sampled_from(["600000", "86400000", "600000", "abc",
                                                    "-1", "", "1.5"]))
    return WireMessage(
        headers=headers,
        body=draw(_weighted((2, _good_bodies), (1, _bodies))),
        content_type=draw(st.sampled_from(["application/json"] * 4 + [
            None, "text/plain", "application/json; charset=utf-8", b"application/json",
            b"\xff\xfeapplication/json"])),
        content_encoding=draw(st.sampled_from([None] * 4 + [
            "utf-8", "UTF-8", "binary", "identity", "gzip", "latin-1", "utf-16", b"\xe9"])),
        extra=extra,
        earlier=earlier,
    )
