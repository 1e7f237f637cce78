"""The wire, checked before anything is decoded or stored.

A transport hands over headers as the broker carried them: text, but also bytes, numbers,
booleans, tables, lists or nothing. idembus's own headers (``idembus.*``) must be text —
valid UTF-8 — or the message is not one idembus can read: coercing them (``str(v)``, a
lossy decode) made two different non-UTF-8 message ids one, and the second was
acknowledged as a duplicate. :func:`text_headers` keeps what is text and says what is not;
:func:`problem_with` adds the checks every transport shares (size, the message id's form).
Such a message goes to the error queue with the reason, its bytes unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import headers as h

if TYPE_CHECKING:
    from .transports.base import Delivery

#: Longest message id accepted, in characters (a uuid has 36). Ids are part of storage keys,
#: which databases index with limits of their own (PostgreSQL: about 2,700 bytes a row).
MAX_MESSAGE_ID_LENGTH = 200
#: Largest body an endpoint accepts unless told otherwise (``Endpoint(max_message_bytes=)``).
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
#: Header listing the headers left out of a delivery because they are not text (and not
#: ``idembus.*``): ``'x-count' (a int), 'blob' (bytes)``. The copies idembus makes of the
#: message (error queue, delayed retry) carry it; the headers it names are not in them.
DROPPED_HEADERS = "idembus.wire.dropped_headers"
#: Content encodings of a body that is the bytes themselves (kombu writes ``binary`` for
#: bytes and ``utf-8`` for text).
PLAIN_ENCODINGS = frozenset({"", "utf-8", "utf8", "binary", "identity"})
#: Longest ``repr`` of a non-text header value kept for an operator to see.
_SHOWN = 200
#: Longest :data:`DROPPED_HEADERS` value, in characters.
_DROPPED_SHOWN = 1000
_PREFIX = "idembus."
#: What a message id may not hold: ASCII control characters and DEL.
_CONTROL_CHARACTER = re.compile("[\x00-\x1f\x7f]")
#: A message version as idembus writes it: ASCII digits only (``str.isdigit`` also takes
#: ``²`` and ``①``, which ``int`` refuses), at most nine of them (no class reaches a
#: billion, and ``int`` refuses very long ones).
_VERSION = re.compile(r"[0-9]{1,9}")


def text_headers(raw: Mapping[Any, Any]) -> tuple[dict[str, str], str | None]:
    """The headers whose names and values are UTF-8 text, and what is wrong, if anything.

    An ``idembus.*`` header whose value is anything but text is a problem; it is kept in
    the result as a bounded ``repr`` so that the error-queue copy shows it. Other headers
    that are not text are not idembus's business: they are left out, and
    :data:`DROPPED_HEADERS` lists them (name and kind, bounded), so that a copy of the
    message — in the error queue, or sent back for a delayed retry — says what it lost.
    A transport leaves out its broker's bookkeeping before calling this. Never raises.
    """
    if _all_text(raw):  # the usual case, checked at C speed
        return dict(raw), None
    headers: dict[str, str] = {}
    problems: list[str] = []
    dropped: list[str] = []
    for name, value in raw.items():
        if not _is_text(name):
            dropped.append(f"{shown(name)} (a name that is not UTF-8 text)")
            continue
        if _is_text(value):
            headers[name] = value
        elif name.startswith(_PREFIX):
            problems.append(f"header {name} is {_kind(value)}, not UTF-8 text")
            headers[name] = shown(value)
        else:
            dropped.append(f"{shown(name)} ({_kind(value)})")
    if dropped:
        earlier = headers.get(DROPPED_HEADERS)
        headers[DROPPED_HEADERS] = _bounded_list([earlier, *dropped] if earlier else dropped)
    return headers, "; ".join(problems) or None


def _bounded_list(items: list[str]) -> str:
    """``items`` joined by ``, ``, within :data:`_DROPPED_SHOWN` characters."""
    text = ""
    for index, item in enumerate(items):
        joined = f"{text}, {item}" if text else item
        if len(joined) > _DROPPED_SHOWN:
            return f"{text}, … {len(items) - index} more" if text else f"… {len(items)} more"
        text = joined
    return text


def problem_with(delivery: Delivery, *, max_message_bytes: int) -> str | None:
    """The first reason ``delivery`` cannot be taken as an idembus message, found before
    decoding: what its transport found (``wire_error``), a body over
    ``max_message_bytes``, a message id too long or with control characters. A missing id
    is left to the decoder, which says so."""
    if delivery.wire_error:
        return delivery.wire_error
    size = len(delivery.body)
    if size > max_message_bytes:
        return f"the body of {size} bytes exceeds max_message_bytes={max_message_bytes}"
    message_id = delivery.headers.get(h.MESSAGE_ID)
    if message_id:
        if len(message_id) > MAX_MESSAGE_ID_LENGTH:
            return (f"the {h.MESSAGE_ID} header has {len(message_id)} characters; at most "
                    f"{MAX_MESSAGE_ID_LENGTH} are accepted")
        if _CONTROL_CHARACTER.search(message_id):
            return f"the {h.MESSAGE_ID} header {shown(message_id)} has control characters"
    return None


def parse_version(text: str) -> int | None:
    """The message version ``text`` names — ASCII digits, from 1 — or ``None`` if it names
    none (``idembus.message_version``, a ``:N`` of ``idembus.enclosed_types``). Never
    raises."""
    if _VERSION.fullmatch(text) is None:
        return None
    version = int(text)
    return version if version >= 1 else None


def encoding_problem(headers: Mapping[Any, Any], encoding: str | None) -> str | None:
    """A body idembus would have to decode or decompress to read (``headers`` as the
    broker carried them): refused as received."""
    if "compression" in headers:  # whatever it says: kombu would decompress by it
        return (f"the body is compressed ({shown(headers['compression'])}); idembus "
                "does not decompress what it receives")
    if (encoding or "").strip().lower() not in PLAIN_ENCODINGS:
        return f"the content encoding {shown(encoding)} is not one idembus reads"
    return None


def joined(*problems: str | None) -> str | None:
    """The problems found, in one text (``None``: none)."""
    return "; ".join(problem for problem in problems if problem) or None


def _all_text(raw: Mapping[Any, Any]) -> bool:
    """Whether every name and value of ``raw`` is text that is valid UTF-8."""
    try:
        "".join(raw).encode("utf-8")
        "".join(raw.values()).encode("utf-8")
    except (TypeError, UnicodeEncodeError):
        return False
    return True


def _is_text(value: Any) -> bool:
    """A ``str`` that is valid UTF-8 (py-amqp reads encoded surrogates into ``str``)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "text that is not valid UTF-8"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if value is None:
        return "empty (void)"
    return f"a {type(value).__name__}"


def shown(value: Any) -> str:
    """A bounded, printable ``repr`` of ``value``."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"
