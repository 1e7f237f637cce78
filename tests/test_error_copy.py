"""The error-queue copy of a failed message always fits the broker: the failure story it
carries is bounded and redacted, whatever the exception said."""

from __future__ import annotations

from collections.abc import Callable

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.failures import (
    HEADERS_BUDGET,
    MAX_EXCEPTION_MESSAGE,
    MAX_STACK_TRACE,
    failure_headers,
)
from idembus.handlers import Handler, handles
from idembus.runtime.recoverability.policy import Recoverability
from idembus.testing import wait_until_idle
from tests.support import Deposit, SignalCounter

SECRET = "pw-9f8e7d"


def _raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as caught:
        return caught


def _weight(headers: dict[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in headers.items())


def test_a_huge_exception_message_and_trace_are_cut_to_their_limits() -> None:
    error = _raised(RuntimeError("é" * 300_000))

    story = failure_headers({h.MESSAGE_ID: "m"}, error, queue="q", immediate_attempts=3)

    assert len(story[h.EXCEPTION_MESSAGE].encode()) <= MAX_EXCEPTION_MESSAGE
    assert len(story[h.STACK_TRACE].encode()) <= MAX_STACK_TRACE
    assert story[h.EXCEPTION_MESSAGE].startswith("éé")
    assert story[h.EXCEPTION_MESSAGE].endswith("…")
    assert story[h.STACK_TRACE].startswith("…")
    assert story[h.STACK_TRACE].rstrip().endswith("é")  # the end: where the exception is
    assert story[h.IMMEDIATE_ATTEMPTS] == "3"


def test_large_original_headers_leave_less_room_for_the_story_but_never_overflow_it() -> None:
    original = {h.MESSAGE_ID: "m", "x-big": "b" * (HEADERS_BUDGET - 4000)}
    error = _raised(RuntimeError("why " * 5000))

    story = failure_headers(original, error, queue="q", immediate_attempts=1)

    assert _weight(story) <= HEADERS_BUDGET
    assert story["x-big"] == original["x-big"]
    assert story[h.EXCEPTION_MESSAGE].startswith("why")


def test_passwords_in_an_exception_never_reach_the_error_queue() -> None:
    error = _raised(ConnectionError(f"cannot reach postgresql://app:{SECRET}@db/sales"))

    story = failure_headers({h.MESSAGE_ID: "m"}, error, queue="q", immediate_attempts=1)

    assert SECRET not in story[h.EXCEPTION_MESSAGE]
    assert SECRET not in story[h.STACK_TRACE]
    assert "postgresql://app:***@db/sales" in story[h.EXCEPTION_MESSAGE]


class Verbose(Handler):
    """Fails with an exception message of a megabyte."""

    @handles
    def deposit(self, message: Deposit) -> None:
        raise ValueError("x" * 1_000_000)


def test_a_failure_with_a_megabyte_of_explanation_still_reaches_the_error_queue(
    make_endpoint: Callable[..., Endpoint],
) -> None:
    # Given an endpoint whose handler explains its failure at length
    verbose = make_endpoint("verbose", handlers=[Verbose],
                            recoverability=Recoverability(
                                retries=RetryPolicy(immediate_retries=0, delayed=())))
    dead_lettered = SignalCounter(verbose, "dead_lettered")
    verbose.start()

    # When a message fails
    message_id = verbose.bus.send(Deposit(account="a", amount=1))

    # Then its copy is in the error queue, with the explanation cut to its limit
    assert dead_lettered.wait_for(1)
    wait_until_idle([verbose])
    copy = verbose.transport.get(verbose.error_queue)
    assert copy is not None
    assert copy.headers[h.MESSAGE_ID] == message_id
    assert copy.headers[h.EXCEPTION_MESSAGE].startswith("xxx")
    assert len(copy.headers[h.EXCEPTION_MESSAGE].encode()) <= MAX_EXCEPTION_MESSAGE
