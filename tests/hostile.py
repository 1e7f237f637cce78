"""A hostile client with publish rights, for ``tests/test_hostile_input.py``.

Messages are published with py-amqp itself (not idembus, not kombu's producer), so that
nothing helps them: header values of any AMQP type, bodies of any bytes, any content type
and encoding. :func:`expected_fate` is the specification of what a running endpoint must do
with each one, written from README's "Wire format" and the guarantee, not from the code.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import amqp
import pydantic
from hypothesis import strategies as st

from idembus import Command
from idembus import headers as h
from idembus.handlers import Handler, handles
from idembus.wire import DEFAULT_MAX_MESSAGE_BYTES, MAX_MESSAGE_ID_LENGTH
from tests.support import Deposit

#: Header carrying the test's own sequence number (plain text), to match error-queue copies.
SEQUENCE = "test.sequence"
#: An account name PostgreSQL cannot index (a btree row holds at most ~2,700 bytes, after
#: compression: so 6,400 bytes that do not compress, the same in every run).
LONG_ACCOUNT = "".join(hashlib.sha256(str(n).encode()).hexdigest() for n in range(100))
#: Accounts the generated deposits go to: few, so that ids and aggregates collide.
ACCOUNTS = ("a", "b", "nul\x00inside", LONG_ACCOUNT)
#: Message ids drawn from a small pool, so that duplicates happen.
ID_POOL = tuple(str(uuid.UUID(int=n)) for n in range(1, 6))


@dataclass
class WireMessage:
    """One message exactly as the hostile client puts it on the wire."""

    headers: dict[str, Any]
    body: bytes
    content_type: str | None = "application/json"
    content_encoding: str | None = None
    sequence: int = 0

    def properties(self) -> dict[str, Any]:
        found: dict[str, Any] = {"application_headers": {**self.headers,
                                                         SEQUENCE: str(self.sequence)}}
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
        virtual_host=vhost or "/")
    connection.connect()
    try:
        channel = connection.channel()
        channel.auto_decode = False  # bodies stay bytes
        channel.confirm_select()
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


def _is_text(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: not UTF-8 on the wire
        return False
    return True


def wire_reason(message: WireMessage) -> str | None:
    """Why the endpoint must refuse ``message`` before handling it, or ``None``."""
    headers = {name: received_value(value) for name, value in message.headers.items()}
    for name, value in headers.items():
        if name.startswith("idembus.") and not _is_text(value):
            return f"header {name} is not text"
    if "compression" in headers:
        return "compressed"
    if (message.content_encoding or "").lower() not in ("", "utf-8", "utf8", "binary",
                                                        "identity"):
        return "encoded"
    if len(message.body) > DEFAULT_MAX_MESSAGE_BYTES:
        return "too large"
    message_id = headers.get(h.MESSAGE_ID)
    if not message_id:
        return "no id"
    if len(message_id) > MAX_MESSAGE_ID_LENGTH or any(ord(c) < 32 or ord(c) == 127
                                                      for c in message_id):
        return "bad id"
    if not headers.get(h.MESSAGE_TYPE):
        return "no type"
    if headers[h.MESSAGE_TYPE] != "test.Deposit":
        return "unknown type"
    media = (message.content_type or "").split(";", 1)[0].strip().lower()
    if media not in ("", "application/json"):
        return "content type"
    try:
        Deposit.model_validate_json(message.body)
    except pydantic.ValidationError:
        return "invalid body"
    return None


def storage_refuses(deposit: Deposit) -> bool:
    """PostgreSQL cannot store a NUL character, nor index a 3,000-byte key."""
    return "\x00" in deposit.account or len(deposit.account.encode()) > 2000


@dataclass
class Model:
    """What the endpoint's effects must be after the messages so far."""

    applied: set[tuple[str, str]] = field(default_factory=set)
    balances: dict[str, int] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)

    def expect(self, message: WireMessage) -> str:
        """``applied``, ``duplicate`` or ``refused`` (the error queue, with a reason)."""
        reason = wire_reason(message)
        if reason is None:
            deposit = Deposit.model_validate_json(message.body)
            if storage_refuses(deposit):
                reason = "storage refuses"
        if reason is not None:
            self.refused[message.sequence] = reason
            return "refused"
        message_id = str(received_value(message.headers[h.MESSAGE_ID]))
        key = (deposit.account, message_id)
        if key in self.applied:
            return "duplicate"
        self.applied.add(key)
        self.balances[deposit.account] = self.balances.get(deposit.account, 0) + deposit.amount
        return "applied"


# -- hostile messages ---------------------------------------------------------------------

_odd_values = st.one_of(
    st.integers(-2**31, 2**31 - 1), st.booleans(), st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.binary(max_size=20).filter(lambda b: isinstance(received_value(b), bytes)),
    st.just(b"\xed\xa0\x80"),  # an encoded lone surrogate: py-amqp gives a str back
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    st.lists(st.integers(0, 9), max_size=3),
)
_text = st.text(max_size=30)


def _deposit_body(account: str, amount: Any) -> bytes:
    return json.dumps({"account": account, "amount": amount}).encode()


_bodies = st.one_of(
    st.builds(_deposit_body, st.sampled_from(ACCOUNTS), st.integers(1, 100)),
    st.builds(_deposit_body, st.sampled_from(ACCOUNTS[:2]), st.integers(1, 100)),
    st.builds(_deposit_body, st.sampled_from(ACCOUNTS[:2]), st.sampled_from(["lots", [1]])),
    st.binary(max_size=40),
    st.just(b"{not json"),
    st.just(b"\xff\xfe\x00"),
    st.builds(lambda account: bz2.compress(_deposit_body(account, 3)),
              st.sampled_from(ACCOUNTS[:2])),
)


@st.composite
def wire_messages(draw: st.DrawFn) -> WireMessage:
    """A message as a hostile or careless client would publish it."""
    headers: dict[str, Any] = {}
    message_id = draw(st.one_of(
        st.sampled_from(ID_POOL), st.sampled_from(ID_POOL), st.sampled_from(ID_POOL),
        st.just(None), st.just(""), _odd_values, _text,
        st.builds(lambda n: "i" * n, st.integers(MAX_MESSAGE_ID_LENGTH - 2,
                                                  MAX_MESSAGE_ID_LENGTH + 2)),
        st.builds(lambda i: i + "\x00", st.sampled_from(ID_POOL)),
        st.builds(lambda i: i.encode(), st.sampled_from(ID_POOL)),
    ))
    if message_id is not None:
        headers[h.MESSAGE_ID] = message_id
    message_type = draw(st.one_of(st.just("test.Deposit"), st.just("test.Deposit"),
                                  st.just(None), _text, _odd_values))
    if message_type is not None:
        headers[h.MESSAGE_TYPE] = message_type
    for name in draw(st.lists(st.sampled_from([h.CORRELATION_ID, h.TIME_SENT, h.REPLY_TO,
                                                "x-custom", "compression", "priority"]),
                              max_size=3, unique=True)):
        headers[name] = draw(st.one_of(_text, _odd_values))
    return WireMessage(
        headers=headers,
        body=draw(_bodies),
        content_type=draw(st.sampled_from(["application/json", None, "text/plain",
                                           "application/json; charset=utf-8"])),
        content_encoding=draw(st.sampled_from([None, None, "utf-8", "binary", "gzip"])),
    )
