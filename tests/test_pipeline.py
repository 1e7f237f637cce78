"""The message pipeline (``Endpoint(middleware=[...])``): hook order, outgoing headers stored
with the message, control flow from hooks and handlers, header propagation, and one sender of
committed messages for every path."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from idembus import (
    Endpoint,
    Middleware,
    PropagateHeaders,
    RejectMessage,
    RetryLater,
    SkipMessage,
    default_middleware,
)
from idembus import headers as h
from idembus.context import MessageContext
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError
from idembus.handlers import Handler, handles
from idembus.pipeline import Dispatch, HandlerCall, IncomingMessage, Pipeline
from idembus.policies import OutboxPolicy
from idembus.runtime.timings import HandlingTimes
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from idembus.transports.kombu import KombuTransport
from tests.support import Account, AccountHandler, Deposit, Deposited, Ledger, SignalCounter

MakeEndpoint = Callable[..., Endpoint]


class Recorder(Middleware):
    """Writes every hook it sees, with its own name, to a shared list."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name = name
        self.calls = calls

    def _note(self, hook: str, error: BaseException | None = None) -> None:
        self.calls.append(f"{self.name}.{hook}" + (f"!{type(error).__name__}" if error else ""))

    def before_message(self, incoming: IncomingMessage) -> None:
        self._note("before_message")

    def after_message(self, incoming: IncomingMessage, error: BaseException | None) -> None:
        self._note("after_message", error)

    def before_handler(self, call: HandlerCall) -> None:
        self._note("before_handler")

    def after_handler(self, call: HandlerCall, error: BaseException | None) -> None:
        self._note("after_handler", error)

    def before_commit(self, call: HandlerCall) -> None:
        self._note("before_commit")

    def after_commit(self, call: HandlerCall, error: BaseException | None) -> None:
        self._note("after_commit", error)

    def before_dispatch(self, dispatch: Dispatch) -> None:
        self._note(f"before_dispatch[{dispatch.source}]")

    def after_dispatch(self, dispatch: Dispatch, error: BaseException | None) -> None:
        self._note(f"after_dispatch[{dispatch.source}]", error)


class Stamp(Middleware):
    """Adds a fresh random header to every outgoing message, before it is committed."""

    def outgoing(self, envelope: Envelope, origin: MessageContext | None) -> Envelope:
        return envelope.with_headers({"stamp": uuid.uuid4().hex})


class Sent(Middleware):
    """Keeps what every dispatch sent, with its source."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Envelope]] = []
        self._lock = threading.Lock()

    def after_dispatch(self, dispatch: Dispatch, error: BaseException | None) -> None:
        if error is None:
            with self._lock:
                self.sent.append((dispatch.source, dispatch.envelope))


def endpoint(name: str, **options: Any) -> Endpoint:
    options.setdefault("storage", MemoryStorage())
    options.setdefault("error_queue", f"error-{name}")
    return Endpoint(name, transport=KombuTransport("memory://"), **options)


def test_before_hooks_run_in_order_and_after_hooks_in_reverse_at_every_stage() -> None:
    # Given two recording middleware around an aggregate handler that publishes one event
    calls: list[str] = []
    accounts = endpoint("accounts", handlers=[AccountHandler],
                        middleware=[Recorder("a", calls), Recorder("b", calls)])
    with accounts:
        # When one deposit is handled
        accounts.bus.send(Deposit(account="x", amount=1))
        wait_until_idle([accounts])

    # Then each stage nests: a before b, b's after before a's, commit inside the handler,
    # the dispatch of what the handler committed inside the message, after the handler
    assert calls == [
        "a.before_dispatch[bus]", "b.before_dispatch[bus]",
        "b.after_dispatch[bus]", "a.after_dispatch[bus]",
        "a.before_message", "b.before_message",
        "a.before_handler", "b.before_handler",
        "a.before_commit", "b.before_commit",
        "b.after_commit", "a.after_commit",
        "b.after_handler", "a.after_handler",
        "a.before_dispatch[handler]", "b.before_dispatch[handler]",
        "b.after_dispatch[handler]", "a.after_dispatch[handler]",
        "b.after_message", "a.after_message",
    ]


def test_an_after_hook_runs_only_when_its_before_hook_returned_and_sees_the_error() -> None:
    # Given middleware a, then b whose before_handler fails, then c
    calls: list[str] = []

    class Failing(Recorder):
        def before_handler(self, call: HandlerCall) -> None:
            super().before_handler(call)
            raise RuntimeError("b refuses")

    accounts = endpoint("accounts", handlers=[AccountHandler],
                        middleware=[Recorder("a", calls), Failing("b", calls),
                                    Recorder("c", calls)],
                        recoverability=_no_retries())
    dead = SignalCounter(accounts, "dead_lettered")
    with accounts:
        accounts.bus.send(Deposit(account="x", amount=1))
        assert dead.wait_for(1)
        wait_until_idle([accounts])

    # Then a's after_handler saw the error, b's and c's after_handler never ran, nothing was
    # committed, and the failure took the retry policy's path to the error queue
    handler_calls = [c for c in calls if "handler" in c]
    assert handler_calls == ["a.before_handler", "b.before_handler",
                             "a.after_handler!RuntimeError"]
    assert not any("commit" in c for c in calls)
    assert accounts.storage.load("Account", "x").exists is False


def test_a_raising_after_hook_is_logged_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Clumsy(Middleware):
        def after_message(self, incoming: IncomingMessage,
                          error: BaseException | None) -> None:
            raise ValueError("clumsy")

    accounts = endpoint("accounts", handlers=[AccountHandler], middleware=[Clumsy()])
    with accounts:
        accounts.bus.send(Deposit(account="x", amount=3))
        wait_until_idle([accounts])
    assert Account.model_validate(accounts.storage.load("Account", "x").state).balance == 3
    assert accounts.counters["dead_lettered"] == 0
    assert "after_message hook" in caplog.text and "clumsy" in caplog.text


def test_headers_added_before_the_commit_are_stored_and_resent_byte_identical(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given an endpoint whose middleware stamps each outgoing message with a random value,
    # which dies once after its commit, so that the redelivery is a duplicate that
    # redispatches what was stored
    class CrashOnceAfterCommit(FaultInjector):
        crashed = False

        def reached(self, point: CrashPoint, message_id: str) -> None:
            if point is CrashPoint.AFTER_COMMIT and not self.crashed:
                self.crashed = True
                raise SimulatedCrash(message_id)

    sent = Sent()
    ledger = Ledger()
    downstream = make_endpoint("ledger", handlers=[ledger])
    accounts = make_endpoint("accounts", handlers=[AccountHandler],
                             middleware=[Stamp(), sent, CrashOnceAfterCommit()],
                             outbox=OutboxPolicy(compact_after_dispatch=False))
    redispatched = SignalCounter(accounts, "redispatched")
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a deposit is handled, its process "dies" after the commit, and it is redelivered
    accounts.bus.send(Deposit(account="x", amount=5))
    assert redispatched.wait_for(1) and recorded.wait_for(1)
    wait_until_idle([accounts, downstream])

    # Then the event went out once (the redispatch), with the stamp stored at the commit:
    # the stamp hook did not run again for it
    events = [envelope for source, envelope in sent.sent if source != "bus"]
    assert [source for source, _ in sent.sent if source != "bus"] == ["redispatch"]
    entry = next(iter(accounts.storage.load("Account", "x").processed.values()))
    assert [dict(e.headers) for e in entry.outgoing] == [dict(e.headers) for e in events]
    assert events[0].headers["stamp"] and ledger.entries[0][0] == events[0].message_id


def test_the_outbox_repair_sends_the_headers_stored_at_the_commit() -> None:
    # Given a unit of work whose process "dies" after its commit, before sending
    sent = Sent()
    accounts = endpoint("accounts", handlers=[AccountHandler], middleware=[Stamp(), sent],
                        outbox=OutboxPolicy(run=False, grace=0))

    def die(*args: Any, **kwargs: Any) -> Any:
        raise SimulatedCrash("died before sending")

    accounts.dispatcher.send_committed = die  # type: ignore[method-assign]
    work = accounts.unit_of_work(Account, "y")
    with pytest.raises(SimulatedCrash), work:
        work.bus.publish(Deposited(account="y", amount=2))
    del accounts.dispatcher.send_committed  # the restarted process sends normally
    assert sent.sent == []
    entry = accounts.storage.load("Account", "y", work.key).processed[work.key]

    # When the outbox repairs the entry
    assert accounts.outbox.run_once() == 1

    # Then it sent the headers stored at the commit (the stamp hook did not run again)
    assert len(entry.outgoing) == 1
    assert [source for source, _ in sent.sent] == ["outbox"]
    assert [dict(e.headers) for _, e in sent.sent] == [dict(e.headers) for e in entry.outgoing]
    assert sent.sent[0][1].headers["stamp"]


def _no_retries() -> Any:
    from idembus import Recoverability, RetryPolicy

    return Recoverability(retries=RetryPolicy(immediate_retries=0, delayed=()))


class Guard(Middleware):
    """Steers messages by a ``steer`` header."""

    def __init__(self) -> None:
        self.seen = 0

    def before_message(self, incoming: IncomingMessage) -> None:
        self.seen += 1
        steer = incoming.headers.get("steer")
        if steer == "skip":
            raise SkipMessage("not for us")
        if steer == "reject":
            raise RejectMessage("tenant unknown")
        if steer == "later" and self.seen == 1:
            raise RetryLater(0.05, "not yet")
        if steer == "forever":
            raise RetryLater(0.01, "never ready", give_up_after=3)


def test_skip_message_acknowledges_without_handling() -> None:
    accounts = endpoint("accounts", handlers=[AccountHandler], middleware=[Guard()])
    skipped = SignalCounter(accounts, "skipped")
    with accounts:
        accounts.bus.send(Deposit(account="x", amount=1), headers={"steer": "skip"})
        assert skipped.wait_for(1)
        wait_until_idle([accounts])
    assert not accounts.storage.load("Account", "x").exists
    assert accounts.counters["handled"] == 0 and accounts.counters["dead_lettered"] == 0
    assert skipped.details[0]["reason"] == "not for us"


def test_reject_message_goes_to_the_error_queue_at_once_with_the_reason() -> None:
    accounts = endpoint("accounts", handlers=[AccountHandler], middleware=[Guard()])
    dead = SignalCounter(accounts, "dead_lettered")
    with accounts:
        message_id = accounts.bus.send(Deposit(account="x", amount=1),
                                       headers={"steer": "reject"})
        assert dead.wait_for(1)
        wait_until_idle([accounts])
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None and copy.headers[h.MESSAGE_ID] == message_id
    assert copy.headers[h.EXCEPTION_TYPE].endswith("RejectMessage")
    assert copy.headers[h.EXCEPTION_MESSAGE] == "tenant unknown"
    assert accounts.counters["failed"] == 0  # no retries, no handler ran


def test_retry_later_brings_the_message_back_with_its_id_and_then_handles_it() -> None:
    guard = Guard()
    accounts = endpoint("accounts", handlers=[AccountHandler], middleware=[guard],
                        delayed_poll_interval=0.02)
    handled = SignalCounter(accounts, "handled")
    with accounts:
        message_id = accounts.bus.send(Deposit(account="x", amount=4),
                                       headers={"steer": "later"})
        assert handled.wait_for(1)
        wait_until_idle([accounts])
    assert guard.seen == 2 and accounts.counters["postponed"] == 1
    assert handled.details[0]["message_id"] == message_id
    assert Account.model_validate(accounts.storage.load("Account", "x").state).balance == 4


def test_retry_later_gives_up_after_its_limit_into_the_error_queue() -> None:
    guard = Guard()
    accounts = endpoint("accounts", handlers=[AccountHandler], middleware=[guard],
                        delayed_poll_interval=0.02)
    dead = SignalCounter(accounts, "dead_lettered")
    with accounts:
        accounts.bus.send(Deposit(account="x", amount=1), headers={"steer": "forever"})
        assert dead.wait_for(1)
        wait_until_idle([accounts])
    assert guard.seen == 4 and accounts.counters["postponed"] == 3
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None and "postponed 3 times" in copy.headers[h.EXCEPTION_MESSAGE]
    assert "never ready" in copy.headers[h.EXCEPTION_MESSAGE]


class Picky(Handler):
    """Skips odd amounts, postpones nothing; counts what it really handled."""

    handled: list[int] = []

    @handles
    def on_deposited(self, message: Deposited) -> None:
        if message.amount % 2:
            raise SkipMessage("odd")
        Picky.handled.append(message.amount)


def test_a_handler_raising_skip_message_skips_itself_only() -> None:
    Picky.handled = []
    ledger = Ledger()
    books = endpoint("books", handlers=[Picky, ledger])
    with books:
        books.bus.publish(Deposited(account="x", amount=1))
        books.bus.publish(Deposited(account="x", amount=2))
        wait_until_idle([books])
    assert Picky.handled == [2]
    assert sorted(amount for _, _, amount in ledger.entries) == [1, 2]
    assert books.counters["skipped"] == 1 and books.counters["failed"] == 0


class Forwarder(Handler):
    @handles
    def on_deposit(self, message: Deposit) -> None:
        self.bus.publish(Deposited(account=message.account, amount=message.amount))


def test_propagated_headers_reach_every_outgoing_message_and_are_stored() -> None:
    # Given an endpoint that carries the tenant header of what it handles
    sent = Sent()
    storage = MemoryStorage()
    forwarder = endpoint("forwarder", handlers=[Forwarder], storage=storage,
                         propagate_headers=("tenant",), middleware=[sent])
    with forwarder:
        message_id = forwarder.bus.send(Deposit(account="x", amount=1),
                                        headers={"tenant": "acme", "other": "dropped"})
        wait_until_idle([forwarder])
    published = [e for source, e in sent.sent if source == "handler"]
    assert len(published) == 1
    assert published[0].headers["tenant"] == "acme" and "other" not in published[0].headers
    key = f"Forwarder/{message_id}"
    stored = storage.load("idembus_inbox", key, key).processed[key]
    assert stored.outgoing_ids == (published[0].message_id,)


def test_propagating_idembus_headers_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="idembus"):
        endpoint("bad", propagate_headers=(h.MESSAGE_ID,))


def test_the_default_middleware_is_one_visible_ordered_list_before_the_user_s() -> None:
    # Before: idembus had no default_middleware; the endpoint built its list inline.
    defaults = default_middleware(("tenant",))
    assert [type(item) for item in defaults] == [HandlingTimes, PropagateHeaders]
    assert defaults[1] == PropagateHeaders(("tenant",))
    assert [type(item) for item in default_middleware()] == [HandlingTimes]
    sent = Sent()
    shop = endpoint("shop", propagate_headers=("tenant",), middleware=[sent])
    assert [type(item) for item in shop.pipeline.middleware] == [
        HandlingTimes, PropagateHeaders, Sent]


def test_the_default_middleware_can_be_reordered_or_replaced() -> None:
    # Given the defaults reordered (propagation first) and an endpoint without timings
    calls: list[str] = []
    first = Recorder("first", calls)
    reordered = [first, *reversed(default_middleware(("tenant",)))]
    forwarder = endpoint("forwarder", handlers=[Forwarder], default_middleware=reordered,
                         middleware=[Recorder("user", calls)])
    assert [type(item) for item in forwarder.pipeline.middleware] == [
        Recorder, PropagateHeaders, HandlingTimes, Recorder]
    bare = endpoint("bare", handlers=[AccountHandler], default_middleware=[])
    assert bare.pipeline.middleware == () and bare.handling_times is None
    # When a message goes through each
    sent = Sent()
    forwarder.add_middleware(sent)
    with forwarder, bare:
        forwarder.bus.send(Deposit(account="x", amount=1), headers={"tenant": "acme"})
        bare.bus.send(Deposit(account="x", amount=1))
        wait_until_idle([forwarder, bare])
    # Then the replaced list is the one that ran, and the endpoint without timings still
    # reports its counters
    messages = [call for call in calls if call.endswith("before_message")]
    assert messages == ["first.before_message", "user.before_message"]
    [published] = [e for source, e in sent.sent if source == "handler"]
    assert published.headers["tenant"] == "acme"
    assert forwarder.handling_times is not None
    assert sum(forwarder.handling_times.snapshot().values()) == 1
    assert bare._reported_counters()["handled"] == 1


def test_propagate_headers_and_a_default_middleware_list_are_not_given_together() -> None:
    with pytest.raises(ConfigurationError, match="PropagateHeaders"):
        endpoint("both", propagate_headers=("tenant",), default_middleware=[])


def test_middleware_must_be_middleware() -> None:
    with pytest.raises(ConfigurationError, match="Middleware"):
        endpoint("bad", middleware=[object()])  # type: ignore[list-item]


def test_every_path_that_sends_a_committed_message_goes_through_one_sender() -> None:
    # Given an endpoint whose dispatch middleware notes each send's source
    sent = Sent()
    accounts = endpoint("accounts", handlers=[AccountHandler], middleware=[sent],
                        outbox=OutboxPolicy(run=False))
    with accounts:
        accounts.bus.send(Deposit(account="x", amount=1))
        wait_until_idle([accounts])
        with accounts.unit_of_work(Account, "y") as work:
            work.bus.publish(Deposited(account="y", amount=1))
    # Then the bus, the handler and the unit of work each sent through the middleware
    assert [source for source, _ in sent.sent] == ["bus", "handler", "unit_of_work"]


class Refusing(Handler):
    @handles
    def on_deposit(self, message: Deposit) -> None:
        if message.amount < 0:
            raise ValueError("negative")


def test_after_message_sees_how_the_message_ended() -> None:
    outcomes: list[tuple[str | None, bool]] = []

    class Outcomes(Middleware):
        def after_message(self, incoming: IncomingMessage,
                          error: BaseException | None) -> None:
            outcomes.append((incoming.outcome, error is None))

    books = endpoint("books", handlers=[Refusing], middleware=[Outcomes()],
                     recoverability=_no_retries())
    with books:
        books.bus.send(Deposit(account="x", amount=1))
        wait_until_idle([books])
        books.bus.send(Deposit(account="x", amount=-1))
        wait_until_idle([books])
    assert outcomes == [("handled", True), ("dead_lettered", True)]


def test_a_failing_before_message_hook_fails_the_message_instead_of_looping() -> None:
    # Given a middleware whose before_message hook always raises (a bug)
    class Broken(Middleware):
        def __init__(self) -> None:
            self.calls = 0

        def before_message(self, incoming: IncomingMessage) -> None:
            self.calls += 1
            raise KeyError("broken middleware")

    broken = Broken()
    accounts = endpoint("accounts", handlers=[AccountHandler], middleware=[broken],
                        recoverability=_no_retries())
    dead = SignalCounter(accounts, "dead_lettered")
    with accounts:
        accounts.bus.send(Deposit(account="x", amount=1))
        assert dead.wait_for(1)
        wait_until_idle([accounts])
    # Then the message went to the error queue with the reason after one try, not requeued
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None and "broken middleware" in copy.headers[h.EXCEPTION_MESSAGE]
    assert broken.calls == 1 and accounts.counters["failed"] == 1


def test_a_crash_in_an_inner_after_hook_still_runs_the_outer_ones_then_goes_on() -> None:
    from idembus.pipeline import Pipeline

    calls: list[str] = []

    class Crashing(Recorder):
        def after_message(self, incoming: IncomingMessage,
                          error: BaseException | None) -> None:
            super().after_message(incoming, error)
            raise SimulatedCrash("dies here")

    pipeline = Pipeline([Recorder("a", calls), Crashing("b", calls)])
    incoming = IncomingMessage("e", "q", {})
    with pytest.raises(SimulatedCrash):
        pipeline.message(incoming, lambda: None)
    assert calls == ["a.before_message", "b.before_message", "b.after_message",
                     "a.after_message!SimulatedCrash"]


def test_a_stage_is_skipped_only_while_no_middleware_hooks_it() -> None:
    # Given a pipeline whose middleware hooks only the outgoing messages
    pipeline = Pipeline([Stamp()])
    assert not pipeline.hooks_commit and not pipeline.hooks_dispatch
    # When middleware hooking every stage is added later
    calls: list[str] = []
    pipeline.append(Recorder("late", calls))
    # Then the commit and dispatch stages are run through it
    assert pipeline.hooks_commit and pipeline.hooks_dispatch
    envelope = Envelope(headers={h.MESSAGE_ID: "m", h.MESSAGE_TYPE: "T"}, body="{}")
    assert pipeline.dispatch(Dispatch(envelope, "e", "handler"), lambda: "sent") == "sent"
    assert [call.split("[")[0] for call in calls] == ["late.before_dispatch",
                                                      "late.after_dispatch"]
