"""The failure headers a message carries into the error queue."""

from __future__ import annotations

import traceback
from collections.abc import Mapping

from bus import headers as h
from bus.envelope import format_utc, utc_now
from bus.errors import MessageError

#: Headers written when a message is moved to the error queue (and ``deliver_at``, left by
#: a delayed retry): a message sent back for another try drops them.
FAILURE_HEADERS = frozenset({
    h.EXCEPTION_TYPE, h.EXCEPTION_MESSAGE, h.STACK_TRACE, h.FAILED_QUEUE, h.TIME_OF_FAILURE,
    h.IMMEDIATE_ATTEMPTS, h.DELAYED_ATTEMPTS, h.DELIVER_AT,
})
_FAILURE_PREFIXES = ("idembus.exception.", "idembus.attempts.")

#: Longest stack trace kept in a header; AMQP frames must hold all headers.
_MAX_STACK_TRACE = 8000


def failure_headers(
    original: Mapping[str, str], error: BaseException, *, queue: str, immediate_attempts: int,
    delayed_attempts: int = 0,
) -> dict[str, str]:
    """The original headers plus the story of the failure (README, "Wire format")."""
    reason = error.reason if isinstance(error, MessageError) else str(error)
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return {
        **original,
        h.EXCEPTION_TYPE: f"{type(error).__module__}.{type(error).__qualname__}",
        h.EXCEPTION_MESSAGE: reason,
        h.STACK_TRACE: trace[-_MAX_STACK_TRACE:],
        h.FAILED_QUEUE: queue,
        h.TIME_OF_FAILURE: format_utc(utc_now()),
        h.IMMEDIATE_ATTEMPTS: str(immediate_attempts),
        h.DELAYED_ATTEMPTS: str(delayed_attempts),
    }


def without_failure_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` without the story of an earlier failure: a message retried afresh."""
    return {name: value for name, value in headers.items()
            if name not in FAILURE_HEADERS and not name.startswith(_FAILURE_PREFIXES)}
