"""The failure headers a message carries into the error queue (part of the wire format:
what an endpoint, a database queue and the error tools all write and read)."""

from __future__ import annotations

from collections.abc import Mapping

from . import headers as h
from .envelope import format_utc, utc_now
from .errors import MessageError
from .redaction import redact, redacted_traceback

#: Headers written when a message is moved to the error queue (and ``deliver_at``, left by
#: a delayed retry): a message sent back for another try drops them. So does its
#: ``discard_after``: an operator's retry (``idembus errors retry``, a parked message, a
#: replay) is handled whatever the sender's deadline was (:mod:`idembus.expiry`).
FAILURE_HEADERS = frozenset({
    h.EXCEPTION_TYPE, h.EXCEPTION_MESSAGE, h.STACK_TRACE, h.FAILED_QUEUE, h.TIME_OF_FAILURE,
    h.IMMEDIATE_ATTEMPTS, h.DELAYED_ATTEMPTS, h.DELIVER_AT, h.DISCARD_AFTER,
    h.CLAIM_CHECK_HOLD,
})
_FAILURE_PREFIXES = ("idembus.exception.", "idembus.attempts.")

#: The most the headers of an error-queue copy may weigh, in UTF-8 bytes. AMQP carries all
#: headers in one frame (RabbitMQ's ``frame_max``: 128 KiB by default); this leaves room for
#: the other properties and a margin.
HEADERS_BUDGET = 96 * 1024
#: Longest exception message kept (UTF-8 bytes); the start is kept.
MAX_EXCEPTION_MESSAGE = 2000
#: Longest stack trace kept (UTF-8 bytes); the end, where the exception is, is kept.
MAX_STACK_TRACE = 8000
#: Longest exception type name kept.
_MAX_TYPE_NAME = 200
_TRUNCATED = "…"


def failure_headers(
    original: Mapping[str, str], error: BaseException, *, queue: str, immediate_attempts: int,
    delayed_attempts: int = 0,
) -> dict[str, str]:
    """The original headers plus the story of the failure (README, "Wire format").

    The story is bounded, so that the copy fits the broker whatever the error said: the
    exception message and stack trace are cut to their limits and, when the original
    headers leave less room than that within :data:`HEADERS_BUDGET`, further. Both pass
    through :func:`~idembus.redaction.redact`: an error about a database must not carry its
    password into the error queue.
    """
    # The copy is due in the error queue now, whatever time the delivery was scheduled
    # for: a deliver_at left in it (a delayed retry's, or one its sender wrote, year 9999
    # say) would have it held back as a delayed message instead.
    original = {name: value for name, value in original.items() if name != h.DELIVER_AT}
    reason = error.reason if isinstance(error, MessageError) else str(error)
    trace = redacted_traceback(error)
    story = {
        h.EXCEPTION_TYPE: _head(f"{type(error).__module__}.{type(error).__qualname__}",
                                _MAX_TYPE_NAME),
        h.FAILED_QUEUE: queue,
        h.TIME_OF_FAILURE: format_utc(utc_now()),
        h.IMMEDIATE_ATTEMPTS: str(immediate_attempts),
        h.DELAYED_ATTEMPTS: str(delayed_attempts),
    }
    room = HEADERS_BUDGET - _weight({**original, **story, h.EXCEPTION_MESSAGE: "",
                                     h.STACK_TRACE: ""})
    message = _head(redact(reason), max(0, min(MAX_EXCEPTION_MESSAGE, room // 2)))
    room -= len(message.encode("utf-8", "surrogateescape"))
    return {
        **original,
        **story,
        h.EXCEPTION_MESSAGE: message,
        h.STACK_TRACE: _tail(trace, max(0, min(MAX_STACK_TRACE, room))),
    }


def _weight(headers: Mapping[str, str]) -> int:
    """The UTF-8 bytes of the names and values of ``headers``."""
    return sum(len(name.encode("utf-8", "surrogateescape"))
               + len(value.encode("utf-8", "surrogateescape")) for name, value in headers.items())


def _head(text: str, limit: int) -> str:
    """The start of ``text`` within ``limit`` UTF-8 bytes, marked if cut."""
    encoded = text.encode("utf-8", "surrogateescape")
    if len(encoded) <= limit:
        return text
    cut = encoded[: max(0, limit - len(_TRUNCATED.encode()))]
    return cut.decode("utf-8", "ignore") + _TRUNCATED if limit else ""


def _tail(text: str, limit: int) -> str:
    """The end of ``text`` within ``limit`` UTF-8 bytes, marked if cut."""
    encoded = text.encode("utf-8", "surrogateescape")
    if len(encoded) <= limit:
        return text
    cut = encoded[len(encoded) - max(0, limit - len(_TRUNCATED.encode())):]
    return _TRUNCATED + cut.decode("utf-8", "ignore") if limit else ""


def without_failure_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` without the story of an earlier failure: a message retried afresh."""
    return {name: value for name, value in headers.items()
            if name not in FAILURE_HEADERS and not name.startswith(_FAILURE_PREFIXES)}
