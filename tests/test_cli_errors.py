"""`idembus errors list|show|retry|purge` on memory://, RabbitMQ, Redis and the database
transports (PostgreSQL, MongoDB on mongomock).

Requirement (the issue): list the failed messages with their type, exception and time;
show one; retry one id, all, or a filter (type, exception), returning each message to its
original queue with its counters reset, where it is processed once; purge.

Each test runs an endpoint whose handlers fail on chosen accounts, with no retries, so the
messages go straight to the error queue. The CLI runs in-process (``idembus.cli.commands.main``) on
an
endpoint reference of its own: a module in ``sys.modules`` whose ``endpoint`` function
builds a second, never started endpoint with the same name, error queue and broker, as
``idembus errors`` in another process would. It is closed by the CLI, the running one is
not. ``idembus errors`` refuses a broker or storage that lives inside one process; the
memory:// broker and the storage the tool endpoint uses are shared by the CLI and the
endpoint *in this test process*, and say so (:class:`SharedMemoryStorage`,
:func:`shared_in_this_process`).
"""

from __future__ import annotations

import json
import sys
import threading
import types
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import idembus.transports.kombu as kombu_transport
from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.cli import errors as cli_errors
from idembus.cli import main
from idembus.cli.supervisor import EXIT_CONFIGURATION
from idembus.envelope import Envelope
from idembus.failures import FAILURE_HEADERS
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from idembus.transports import kombu_frames
from idembus.transports.kombu import KombuTransport
from tests.conftest import ALL_TRANSPORT_URLS, is_kombu_url, required_transport
from tests.support import Account, Deposit, Deposited, Ledger, SignalCounter

MakeEndpoint = Callable[..., Endpoint]
NO_RETRIES = RetryPolicy(immediate_retries=0, delayed=())


@pytest.fixture(params=ALL_TRANSPORT_URLS)
def transport_url(request: pytest.FixtureRequest) -> str:
    """Every transport: an error queue is a queue on each of them."""
    return required_transport(request.param)


class SharedMemoryStorage(MemoryStorage):
    """A MemoryStorage shared in this test process: the CLI, run in-process by these tests,
    sees what another endpoint object wrote to it, as another process sees a database."""

    process_local = False


def shared_in_this_process(transport: KombuTransport) -> KombuTransport:
    """``transport`` as a broker other processes could reach: memory:// is one, for the
    CLI run in this test process (RabbitMQ and Redis are anyway)."""
    transport.process_local = False
    return transport


class AccountFrozen(Exception):
    """What a frozen account raises (a second exception type to filter on)."""


class FlakyAccounts(AggregateHandler[Account]):
    """Deposits on an account, unless ``failing`` names an exception for it; records the
    headers of every message it handles."""

    def __init__(self, failing: dict[str, type[Exception]], seen: list[dict[str, str]]) -> None:
        self.failing = failing
        self.seen = seen

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    def deposit(self, message: Deposit) -> None:
        error = self.failing.get(message.account)
        if error is not None:
            raise error(f"account {message.account} cannot take deposits")
        self.seen.append(dict(self.context.headers))
        self.state.balance += message.amount
        self.state.deposits += 1


class Auditor(Handler):
    """Audits every Deposited event, unless ``failing`` names an exception for its account."""

    def __init__(self, failing: dict[str, type[Exception]]) -> None:
        self.failing = failing
        self.audited: list[str] = []

    @handles
    def audit(self, message: Deposited) -> None:
        error = self.failing.get(message.account)
        if error is not None:
            raise error(f"the audit of {message.account} failed")
        self.audited.append(self.context.message_id)


@dataclass
class ErrorsApp:
    """A running endpoint with failing handlers, and the CLI reference to it."""

    endpoint: Endpoint
    reference: str
    failing: dict[str, type[Exception]]
    seen: list[dict[str, str]]
    ledger: Ledger
    auditor: Auditor
    signals: dict[str, SignalCounter] = field(default_factory=dict)

    def deposit(self, account: str, amount: int = 10) -> str:
        """Send a deposit to the endpoint; its message id."""
        return self.endpoint.bus.send(Deposit(account=account, amount=amount))

    def publish(self, account: str, amount: int = 10) -> str:
        """Publish a Deposited event the endpoint subscribes to; its message id."""
        return self.endpoint.bus.publish(Deposited(account=account, amount=amount))

    def wait(self, signal: str, count: int) -> None:
        counter = self.signals[signal]
        assert counter.wait_for(count), f"{signal}: {counter.count} of {count}"

    def settle(self) -> None:
        """Wait until the endpoint has processed everything it has."""
        wait_until_idle([self.endpoint])

    def account(self, account: str) -> Account:
        return Account.model_validate(self.endpoint.storage.load("Account", account).state)

    def handled(self, message_id: str) -> list[dict[str, Any]]:
        return [d for d in self.signals["handled"].details if d["message_id"] == message_id]


@pytest.fixture
def app(make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
        monkeypatch: pytest.MonkeyPatch) -> ErrorsApp:
    failing: dict[str, type[Exception]] = {}
    seen: list[dict[str, str]] = []
    ledger, auditor = Ledger(), Auditor(failing)
    endpoint = make_endpoint("accounts", storage=MemoryStorage(),
                             recoverability=Recoverability(retries=NO_RETRIES),
                             handlers=[FlakyAccounts(failing, seen), ledger, auditor])
    module_name = f"cli_errors_app_{uuid.uuid4().hex[:8]}"
    module = types.ModuleType(module_name)
    tool_storage = SharedMemoryStorage()  # the tool's database: one for every run

    def tool_endpoint() -> Endpoint:
        return Endpoint(endpoint.name, transport=shared_in_this_process(make_transport()),
                        storage=tool_storage, error_queue=endpoint.error_queue)

    module.endpoint = tool_endpoint  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module_name, module)
    running = ErrorsApp(endpoint, f"{module_name}:endpoint", failing, seen, ledger, auditor)
    for name in ("handled", "duplicate", "dead_lettered"):
        running.signals[name] = SignalCounter(endpoint, name)
    endpoint.start()
    return running


def idembus(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``idembus errors ...`` in this process: exit status, stdout, stderr."""
    capsys.readouterr()
    status = main(["errors", *args])
    out, err = capsys.readouterr()
    return status, out, err


def listed(capsys: pytest.CaptureFixture[str], app: ErrorsApp,
           *filters: str) -> list[dict[str, Any]]:
    """The rows of ``errors list --json`` with ``filters``."""
    status, out, _ = idembus(capsys, "list", app.reference, "--json", *filters)
    assert status == 0
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def ids_in_error_queue(capsys: pytest.CaptureFixture[str], app: ErrorsApp) -> list[str]:
    """The message ids in the error queue, sorted (as the CLI lists them)."""
    return sorted(row["message_id"] for row in listed(capsys, app))


def fail_deposits(app: ErrorsApp, errors: dict[str, type[Exception]]) -> dict[str, str]:
    """Deposit on each account while it fails; account -> message id, once all failed."""
    app.failing.update(errors)
    before = app.signals["dead_lettered"].count
    ids = {account: app.deposit(account) for account in errors}
    app.wait("dead_lettered", before + len(ids))
    return ids


# -- list and show ----------------------------------------------------------------------


def test_list_shows_each_failed_message_with_its_type_exception_time_and_attempts(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given two deposits and an event that failed, and a deposit that succeeded
    ids = fail_deposits(app, {"a": ValueError, "b": AccountFrozen})
    app.failing["c"] = ValueError
    event_id = app.publish("c")
    app.wait("dead_lettered", 3)
    app.deposit("fine")
    app.wait("handled", 2)  # the good deposit, and the event's Ledger entry

    # When the error queue is listed as JSON
    rows = {row["message_id"]: row for row in listed(capsys, app)}

    # Then each failed message is there once, with what failed, where, when and how often
    assert sorted(rows) == sorted([*ids.values(), event_id])
    assert rows[ids["a"]]["message_type"] == "test.Deposit"
    assert rows[ids["a"]]["exception_type"] == "builtins.ValueError"
    assert rows[ids["a"]]["exception_message"] == "account a cannot take deposits"
    assert rows[ids["b"]]["exception_type"] == f"{__name__}.AccountFrozen"
    assert rows[event_id]["message_type"] == "test.Deposited"
    for row in rows.values():
        assert row["failed_queue"] == app.endpoint.name
        assert row["time_of_failure"]
        assert (row["immediate_attempts"], row["delayed_attempts"]) == (1, 0)  # numbers

    # And the table says the same, one row per message
    status, out, _ = idembus(capsys, "list", app.reference)
    assert status == 0
    lines = out.splitlines()
    assert lines[0].startswith("MESSAGE ID")
    for message_id in rows:
        [line] = [line for line in lines if line.startswith(message_id)]
        assert app.endpoint.name in line and "1/0" in line
    assert "builtins.ValueError" in out and "account a cannot take deposits" in out
    assert lines[-1] == f"3 failed message(s) in {app.endpoint.error_queue!r}"

    # And filters select by exact type and by full or last exception name
    assert {r["message_id"] for r in listed(capsys, app, "--exception", "ValueError")} == {
        ids["a"], event_id}
    assert {r["message_id"] for r in listed(capsys, app, "--exception",
                                            f"{__name__}.AccountFrozen")} == {ids["b"]}
    assert {r["message_id"] for r in listed(capsys, app, "--type", "test.Deposited")} == {
        event_id}
    assert listed(capsys, app, "--type", "Deposit") == []

    # And looking changed nothing: all three are still in the error queue
    assert ids_in_error_queue(capsys, app) == sorted([*ids.values(), event_id])


def test_show_prints_every_header_and_the_body(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a failed deposit
    message_id = fail_deposits(app, {"a": AccountFrozen})["a"]

    # When it is shown as JSON
    status, out, _ = idembus(capsys, "show", app.reference, message_id, "--json")

    # Then every header and the body are there
    assert status == 0
    [shown] = json.loads(out)
    headers = shown["headers"]
    assert headers[h.MESSAGE_ID] == message_id
    assert headers[h.MESSAGE_TYPE] == "test.Deposit"
    assert headers[h.EXCEPTION_TYPE] == f"{__name__}.AccountFrozen"
    assert "Traceback" in headers[h.STACK_TRACE]
    assert headers[h.FAILED_QUEUE] == app.endpoint.name
    assert {h.TIME_OF_FAILURE, h.TIME_SENT, h.IMMEDIATE_ATTEMPTS} <= set(headers)
    assert json.loads(shown["body"]) == {"account": "a", "amount": 10}
    assert shown["content_type"] == h.CONTENT_TYPE

    # And the text form prints the same headers and the body
    status, out, _ = idembus(capsys, "show", app.reference, message_id)
    assert status == 0
    for name, value in headers.items():
        assert f"  {name}: {value.splitlines()[0]}" in out
    assert out.rstrip().endswith(shown["body"])

    # And the message is still in the error queue
    assert ids_in_error_queue(capsys, app) == [message_id]


# -- retry ------------------------------------------------------------------------------


def test_retry_one_id_returns_only_that_message_which_is_processed_once_with_counters_reset(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given three failed deposits, and the cause of the failures fixed
    ids = fail_deposits(app, {"a": ValueError, "b": ValueError, "c": ValueError})
    app.failing.clear()

    # When one of them is retried
    status, out, _ = idembus(capsys, "retry", app.reference, ids["b"])

    # Then it is processed once, on the endpoint's queue...
    assert status == 0
    assert f"retried {ids['b']} to {app.endpoint.name!r}" in out
    assert out.splitlines()[-1] == f"1 message(s) retried from {app.endpoint.error_queue!r}"
    app.wait("handled", 1)
    app.settle()
    assert len(app.handled(ids["b"])) == 1
    assert app.account("b") == Account(balance=10, deposits=1)
    # ... as the same message, without the failure headers, its attempts counted afresh
    [headers] = app.seen
    assert headers[h.MESSAGE_ID] == ids["b"]
    assert not FAILURE_HEADERS & set(headers)
    assert not [name for name in headers if name.startswith(("idembus.exception.",
                                                             "idembus.attempts."))]

    # And it is gone from the error queue; the others stay
    assert ids_in_error_queue(capsys, app) == sorted([ids["a"], ids["c"]])
    assert app.signals["handled"].count == 1


def test_retry_by_exception_or_by_type_selects_what_matches(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given deposits failed with ValueError and AccountFrozen, and an event with ValueError
    ids = fail_deposits(app, {"a": ValueError, "b": AccountFrozen})
    app.failing["c"] = ValueError
    event_id = app.publish("c")
    app.wait("dead_lettered", 3)
    handled_before = app.signals["handled"].count  # the event's Ledger entry
    app.failing.clear()

    # When the AccountFrozen ones are retried (by the exception's last name)
    status, out, _ = idembus(capsys, "retry", app.reference, "--exception", "AccountFrozen")

    # Then only b was retried and processed
    assert status == 0 and "1 message(s) retried" in out
    app.wait("handled", handled_before + 1)
    app.settle()
    assert app.account("b").deposits == 1
    assert ids_in_error_queue(capsys, app) == sorted([ids["a"], event_id])

    # When the events are retried by type
    status, out, _ = idembus(capsys, "retry", app.reference, "--type", "test.Deposited")

    # Then only the event was retried: the auditor ran once, the ledger found it processed
    assert status == 0 and "1 message(s) retried" in out
    app.wait("handled", handled_before + 2)
    app.settle()
    assert app.auditor.audited == [event_id]
    assert [entry[0] for entry in app.ledger.entries] == [event_id]
    assert ids_in_error_queue(capsys, app) == [ids["a"]]
    assert app.signals["handled"].count == handled_before + 2


def test_retry_all_returns_every_failed_message(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given three failed deposits, and the cause fixed
    ids = fail_deposits(app, {"a": ValueError, "b": AccountFrozen, "c": ValueError})
    app.failing.clear()

    # When all are retried
    status, out, _ = idembus(capsys, "retry", app.reference, "--all")

    # Then each is processed once and the error queue is empty
    assert status == 0 and "3 message(s) retried" in out
    app.wait("handled", 3)
    app.settle()
    for account, message_id in ids.items():
        assert len(app.handled(message_id)) == 1
        assert app.account(account) == Account(balance=10, deposits=1)
    assert ids_in_error_queue(capsys, app) == []
    assert app.signals["handled"].count == 3


def test_a_retried_event_that_had_partly_succeeded_is_not_applied_twice(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given an event whose ledger handler committed and whose auditor failed
    app.failing["a"] = ValueError
    event_id = app.publish("a", amount=7)
    app.wait("dead_lettered", 1)
    assert app.ledger.entries == [(event_id, "a", 7)]
    app.failing.clear()

    # When it is retried
    status, _, _ = idembus(capsys, "retry", app.reference, event_id)
    assert status == 0

    # Then the auditor handles it, and the ledger finds it already processed (same id)
    app.wait("handled", 2)
    app.wait("duplicate", 1)
    app.settle()
    assert app.auditor.audited == [event_id]
    assert app.ledger.entries == [(event_id, "a", 7)]
    assert [d["message_id"] for d in app.signals["duplicate"].details] == [event_id]
    assert ids_in_error_queue(capsys, app) == []


# -- purge ------------------------------------------------------------------------------


def test_purge_all_empties_the_error_queue_and_nothing_is_processed(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given three failed deposits
    fail_deposits(app, {"a": ValueError, "b": AccountFrozen, "c": ValueError})
    app.failing.clear()

    # When the error queue is purged
    status, out, _ = idembus(capsys, "purge", app.reference, "--all", "--yes")

    # Then it is empty, and nothing went back to the endpoint
    assert status == 0
    assert out.strip() == f"3 message(s) purged from {app.endpoint.error_queue!r}"
    assert app.endpoint.transport.pending(app.endpoint.error_queue) == 0
    assert ids_in_error_queue(capsys, app) == []
    app.settle()
    assert app.signals["handled"].count == 0


def test_purge_by_id_or_filter_deletes_only_the_selected(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    ids = fail_deposits(app, {"a": ValueError, "b": AccountFrozen, "c": ValueError})

    status, out, _ = idembus(capsys, "purge", app.reference, ids["a"], "--yes")
    assert status == 0 and "1 message(s) purged" in out
    assert ids_in_error_queue(capsys, app) == sorted([ids["b"], ids["c"]])

    status, out, _ = idembus(capsys, "purge", app.reference, "--exception", "AccountFrozen",
                           "--yes")
    assert status == 0 and "1 message(s) purged" in out
    assert ids_in_error_queue(capsys, app) == [ids["c"]]


# -- mistakes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "complaint"),
    [
        (("retry", "{ref}", "no-such-id"), "no message no-such-id in the error queue"),
        (("retry", "{ref}", "{id}", "no-such-id"), "no message no-such-id in the error queue"),
        (("show", "{ref}", "no-such-id"), "no message no-such-id in the error queue"),
        (("purge", "{ref}", "no-such-id"), "no message no-such-id in the error queue"),
        (("purge", "{ref}"), "errors purge needs a selection"),
        (("retry", "{ref}"), "errors retry needs a selection"),
        (("retry", "{ref}", "{id}", "--all"), "not several of them"),
        (("purge", "{ref}", "--all", "--type", "test.Deposit"), "not several of them"),
    ],
)
def test_an_unknown_id_or_a_missing_selection_exits_2_and_changes_nothing(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str], arguments: tuple[str, ...],
    complaint: str,
) -> None:
    # Given a failed deposit
    message_id = fail_deposits(app, {"a": ValueError})["a"]
    app.failing.clear()

    # When the command names a message that is not there, or selects nothing or too much
    status, out, err = idembus(
        capsys, *(a.format(ref=app.reference, id=message_id) for a in arguments))

    # Then it exits 2 saying what is wrong, and the error queue is as it was
    assert status == EXIT_CONFIGURATION
    assert complaint in err
    assert ids_in_error_queue(capsys, app) == [message_id]
    assert app.signals["handled"].count == 0


# -- a shared broker ----------------------------------------------------------------------


def test_purge_asks_unless_yes_and_dry_run_purges_nothing(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    ids = fail_deposits(app, {"a": ValueError, "b": ValueError})

    # Not at a terminal, without --yes: refused, nothing purged
    status, _, err = idembus(capsys, "purge", app.reference, "--all")
    assert status == EXIT_CONFIGURATION and "--yes" in err
    # --dry-run: says what would go, purges nothing
    status, out, _ = idembus(capsys, "purge", app.reference, "--all", "--dry-run")
    assert status == 0 and "2 message(s) would be purged" in out
    assert ids_in_error_queue(capsys, app) == sorted(ids.values())


def test_only_the_messages_that_failed_in_this_endpoints_queue_unless_all_endpoints(
    app: ErrorsApp, make_endpoint: MakeEndpoint, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given another endpoint whose failures share the error queue
    other_failing: dict[str, type[Exception]] = {"x": ValueError}
    other = make_endpoint("other", storage=MemoryStorage(),
                          recoverability=Recoverability(retries=NO_RETRIES),
                          handlers=[FlakyAccounts(other_failing, [])])
    other_dead = SignalCounter(other, "dead_lettered")
    other.start()
    theirs = other.bus.send(Deposit(account="x", amount=1))
    assert other_dead.wait_for(1)
    ours = fail_deposits(app, {"a": ValueError})["a"]

    # Then this endpoint's commands see only its own, and all with --all-endpoints
    assert ids_in_error_queue(capsys, app) == [ours]
    status, out, _ = idembus(capsys, "list", app.reference, "--json", "--all-endpoints")
    assert status == 0
    assert sorted(row["message_id"] for row in json.loads(out)) == sorted([ours, theirs])
    status, _, _ = idembus(capsys, "purge", app.reference, "--all", "--yes")
    assert status == 0
    status, out, _ = idembus(capsys, "list", app.reference, "--json", "--all-endpoints")
    assert [row["message_id"] for row in json.loads(out)] == [theirs]


class Shouts(Exception):
    """An exception whose message carries terminal escape sequences."""


def test_control_characters_from_the_queue_are_escaped_on_the_terminal(
    app: ErrorsApp, capsys: pytest.CaptureFixture[str],
) -> None:
    app.failing["\x1b[2Jwiped"] = Shouts
    message_id = fail_deposits(app, {"\x1b[2Jwiped": Shouts})["\x1b[2Jwiped"]

    for command in (("list", app.reference), ("show", app.reference, message_id)):
        status, out, _ = idembus(capsys, *command)
        assert status == 0
        assert "\x1b" not in out and "\\x1b[2Jwiped" in out


def test_an_unreachable_broker_is_exit_2_with_one_line_never_zero_messages(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType("unreachable_errors_app")
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        "unreachable", transport=KombuTransport("amqp://guest:guest@127.0.0.1:1//"),
        storage=SharedMemoryStorage())
    monkeypatch.setitem(sys.modules, "unreachable_errors_app", module)

    status, out, err = idembus(capsys, "list", "unreachable_errors_app:endpoint")

    assert status == EXIT_CONFIGURATION
    assert "cannot read the failed messages of unreachable" in err
    assert len(err.strip().splitlines()) == 1 and "message(s)" not in out


# -- what another process can see --------------------------------------------------------


@pytest.mark.parametrize(("transport", "storage", "unseen"), [
    ("memory://", SharedMemoryStorage, "transport of endpoint 'local' (KombuTransport) is "
     "process-local: another process cannot see its error queue"),
    ("shared memory://", MemoryStorage, "storage of endpoint 'local' (MemoryStorage) is "
     "process-local: another process cannot see its parked messages"),
    ("memory://", None, "transport of endpoint 'local' (KombuTransport) is process-local"),
], ids=["memory-broker", "memory-storage", "defaults"])
@pytest.mark.parametrize("command", [("list",), ("show", "m-1"), ("retry", "--all"),
                                     ("purge", "--all", "--yes")],
                         ids=lambda command: command[0])
def test_an_endpoint_another_process_cannot_see_is_refused_with_exit_2_and_the_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    transport: str, storage: type[MemoryStorage] | None, unseen: str,
    command: tuple[str, ...],
) -> None:
    # Given an endpoint whose broker or storage lives inside its own process (the defaults:
    # memory:// and a MemoryStorage)
    def local() -> Endpoint:
        broker = KombuTransport("memory://")
        if transport.startswith("shared"):
            shared_in_this_process(broker)
        return Endpoint("local", transport=broker,
                        **({"storage": storage()} if storage is not None else {}))

    module = types.ModuleType("process_local_errors_app")
    module.endpoint = local  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "process_local_errors_app", module)

    # When idembus errors looks at it
    status, out, err = idembus(capsys, command[0], "process_local_errors_app:endpoint",
                               *command[1:])

    # Then it refuses with exit status 2 and says why, in one line, instead of "0 messages"
    assert status == EXIT_CONFIGURATION
    assert unseen in err
    assert len(err.strip().splitlines()) == 1 and out == ""


# -- long error queues -------------------------------------------------------------------


class HeldMessages:
    """Counts the broker messages this process holds (kombu message objects not yet
    garbage) and the most it held at once."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self._lock = threading.Lock()

    def created(self, message: object) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        weakref.finalize(message, self._released)

    def _released(self) -> None:
        with self._lock:
            self.now -= 1


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch, transport_url: str) -> HeldMessages:
    """Every message the transport hands this process: a raw message of idembus's kombu
    channels, or a delivery of a database transport (a row, a document)."""
    spy = HeldMessages()
    if transport_url.startswith(("amqp", "pyamqp")):
        # RabbitMQ's messages set their fields in one call, past _RawBody.__init__
        held_class: Any = kombu_frames._RawAmqpBody
    elif is_kombu_url(transport_url):
        held_class = kombu_transport._RawBody
    elif transport_url.startswith("postgres"):
        from idembus.transports.postgres import _PostgresDelivery as held_class
    else:
        from idembus.transports.mongo import _MongoDelivery as held_class
    original = held_class.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        spy.created(self)

    monkeypatch.setattr(held_class, "__init__", counted)
    return spy


def test_a_long_error_queue_is_listed_and_exported_a_page_at_a_time_and_kept_whole(
    make_transport: Callable[..., KombuTransport], queue_name: Callable[[str], str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    held: HeldMessages, tmp_path: Any,
) -> None:
    # Given an error queue of 60 failed messages, read 10 at a time
    monkeypatch.setattr(cli_errors, "PAGE", 10)
    name, error_queue = queue_name("long"), queue_name("long-error")
    transport = make_transport()
    transport.declare(error_queue)
    sent = [f"m-{number:02d}" for number in range(60)]
    for message_id in sent:
        transport.send(Envelope(
            {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.Deposit", h.FAILED_QUEUE: name,
             h.EXCEPTION_TYPE: "builtins.ValueError", h.EXCEPTION_MESSAGE: "no"},
            '{"account": "a", "amount": 1}', error_queue))
    module = types.ModuleType("long_errors_app")
    storage = SharedMemoryStorage()
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        name, transport=shared_in_this_process(make_transport()),
        storage=storage, error_queue=error_queue)
    monkeypatch.setitem(sys.modules, "long_errors_app", module)

    # When it is listed, as a table and as JSON, and exported
    status, table, _ = idembus(capsys, "list", "long_errors_app:endpoint")
    assert status == 0
    listed_most = held.most
    status, out, _ = idembus(capsys, "list", "long_errors_app:endpoint", "--json")
    assert status == 0
    rows = json.loads(out)
    export = tmp_path / "failed.json"
    status, _, _ = idembus(capsys, "export", "long_errors_app:endpoint", str(export))
    assert status == 0

    # Then every message is there once (in the order of the queue, which RabbitMQ's quorum
    # queues may change as messages come back)
    lines = table.splitlines()
    assert lines[0].startswith("MESSAGE ID") and lines[-1].startswith("60 failed message(s)")
    assert sorted(line.split()[0] for line in lines[1:-1]) == sent
    assert sorted(row["message_id"] for row in rows) == sent
    assert sorted(json.loads(line)["message_id"]
                  for line in export.read_text().splitlines()) == sent
    # And the process never held more than about a page of them, not the whole queue
    assert 0 < listed_most <= 2 * cli_errors.PAGE, listed_most
    assert held.most <= 2 * cli_errors.PAGE, held.most
    # And every one was moved from the error queue into the storage, whole and once
    assert transport.pending(error_queue) == 0
    kept = storage.parked_messages(name)
    assert sorted(parked.envelope.message_id for parked in kept) == sent
