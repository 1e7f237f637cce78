"""Logs an operator can read: what an endpoint is at start, what it did at stop, one DEBUG
line per message and handler, the traceback of a dead-lettered message, repeated outage
lines held back (in every thread that waits out an outage), and JSON lines for machines —
every one redacted."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from idembus import Backoff, RetryPolicy
from idembus.handlers import handles
from idembus.logs import JsonFormatter, MessageLog, Throttle, loggable
from idembus.runtime.background import Periodic
from idembus.runtime.endpoint import _described
from idembus.runtime.recoverability.policy import Recoverability
from idembus.runtime.status import StatusReporter
from idembus.signals import EndpointSignals
from idembus.storage.base import StatusReport
from idembus.storage.errors import StorageAccessDenied, StorageUnavailable
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing import wait_until_idle
from idembus.testing.faults import CrashPoint
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.support import AccountHandler, Deposit, SignalCounter
from tests.test_failure_matrix import CrashAt

ROOT = pathlib.Path(__file__).resolve().parent.parent


def messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == logger]


def test_start_and_stop_say_what_the_endpoint_is_and_what_it_did(
    make_endpoint, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="idembus.runtime.endpoint")
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=MemoryStorage())
    handled = SignalCounter(accounts, "handled")

    accounts.start()
    accounts.bus.send(Deposit(account="a", amount=1))
    assert handled.wait_for(1)
    accounts.stop()

    lines = [record.getMessage() for record in messages(caplog, "idembus.runtime.endpoint")]
    started = next(line for line in lines if "started" in line)
    for part in (accounts.name, "AccountHandler", "1 consumer(s)", "KombuTransport",
                 "MemoryStorage"):
        assert part in started, started
    stopped = next(line for line in lines if "stopped" in line)
    assert "handled 1" in stopped and "received 1" in stopped
    # And a process-local storage is called what it is
    warnings = [r.getMessage() for r in messages(caplog, "idembus.runtime.endpoint")
                if r.levelno == logging.WARNING]
    assert any("process-local and not durable" in line for line in warnings)


def test_transports_and_storages_are_described_without_their_passwords() -> None:
    storage = PostgresStorage("postgresql://app:Pw-Hidden-1@db.example/x")
    transport = KombuTransport("amqp://app:Pw-Hidden-2@broker.example//")
    try:
        described = _described(storage) + " " + _described(transport)
    finally:
        storage.close()
        transport.close()
    assert "db.example" in described and "broker.example" in described
    assert "Pw-Hidden" not in described


def test_debug_shows_each_message_and_handler_with_milliseconds(
    make_endpoint, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="idembus.messages")
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    with accounts:
        message_id = accounts.bus.send(Deposit(account="a", amount=1))
        accounts.bus.send(Deposit(account="a", amount=1), message_id=message_id)
        wait_until_idle([accounts])

    lines = [r for r in messages(caplog, "idembus.messages") if r.message_id == message_id]
    events = [r.getMessage().split()[1] for r in lines]
    assert events.count("received") == 2
    assert "handled" in events and "duplicate" in events
    handled = next(r for r in lines if " handled " in r.getMessage())
    assert handled.handler == "AccountHandler" and handled.getMessage().endswith(" ms)")


def test_debug_shows_what_a_handler_sent_and_what_its_redelivery_sent_again(
    make_endpoint, caplog: pytest.LogCaptureFixture,
) -> None:
    # Given an endpoint that dies once after committing a deposit, before sending Deposited
    caplog.set_level(logging.DEBUG, logger="idembus.messages")
    deposit_id = str(uuid.uuid4())
    accounts = make_endpoint("accounts", handlers=[AccountHandler],
                             middleware=[CrashAt(CrashPoint.AFTER_COMMIT, deposit_id)])
    redispatched = SignalCounter(accounts, "redispatched")
    with accounts:
        accounts.bus.send(Deposit(account="a", amount=1), message_id=deposit_id)
        assert redispatched.wait_for(1)
        wait_until_idle([accounts])

    # Then the redelivery's line says which handler's stored messages went out again
    lines = messages(caplog, "idembus.messages")
    [again] = [r for r in lines if " redispatched " in r.getMessage()]
    assert again.message_id == deposit_id and again.handler == "AccountHandler"
    assert f"{deposit_id} by AccountHandler (" in again.getMessage()
    assert again.getMessage().endswith(" ms)")
    # And the line of the message that went out names it, not the deposit
    [sent] = [r for r in lines if " dispatched " in r.getMessage()]
    assert sent.message_type == "test.Deposited" and sent.message_id != deposit_id
    assert sent.message_id in sent.getMessage() and sent.getMessage().endswith(" ms)")
    # And the JSON lines carry the handler where there is one
    entry = json.loads(JsonFormatter().format(again))
    assert (entry["handler"], entry["message_id"]) == ("AccountHandler", deposit_id)
    assert "handler" not in json.loads(JsonFormatter().format(sent))


def test_the_message_lines_cost_nothing_without_debug(
    make_endpoint, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="idembus.messages")
    quiet = make_endpoint("quiet", handlers=[AccountHandler])
    with quiet:
        without_debug = len(quiet.signals.received.receivers)
    caplog.set_level(logging.DEBUG, logger="idembus.messages")
    chatty = make_endpoint("chatty", handlers=[AccountHandler])
    with chatty:
        assert len(chatty.signals.received.receivers) == without_debug + 1


class Refuses(AccountHandler):
    @handles
    def deposit(self, message: Deposit) -> None:
        raise ValueError(f"account {message.account} is frozen")


def test_a_dead_lettered_message_logs_its_traceback(
    make_endpoint, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="idembus.runtime.processing")
    accounts = make_endpoint("accounts", handlers=[Refuses],
                             recoverability=Recoverability(
                                 retries=RetryPolicy(immediate_retries=0, delayed=())))
    dead = SignalCounter(accounts, "dead_lettered")
    with accounts:
        message_id = accounts.bus.send(Deposit(account="a", amount=1))
        assert dead.wait_for(1)
        wait_until_idle([accounts])

    [moved] = [r for r in messages(caplog, "idembus.runtime.processing")
               if "moved" in r.getMessage()]
    assert moved.levelno == logging.WARNING and moved.message_id == message_id
    assert moved.exc_info is not None and moved.exc_info[0] is ValueError
    assert "account a is frozen" in caplog.text and "Traceback" in caplog.text


def test_a_repeated_line_is_let_through_once_per_interval_with_a_count() -> None:
    throttle = Throttle(interval=3600)
    assert throttle.allow("outage") == 0
    assert throttle.allow("outage") is None
    assert throttle.allow("outage") is None
    assert throttle.allow("other cause") == 0
    throttle.interval = 0
    assert throttle.allow("outage") == 2


class Failures:
    """Counts the failures of something that keeps failing, and lets a test wait for them."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    def happened(self) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait_for(self, count: int, timeout: float = 20.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.count >= count, timeout)


class DatabaseDown(Periodic):
    """A helper thread whose database stays down: each round raises ``errors`` in turn."""

    def __init__(self, failures: Failures, *errors: type[StorageUnavailable]) -> None:
        super().__init__("idembus-test-helper", backoff=Backoff((0.001,)))
        self.failures = failures
        self.errors = errors

    def round(self) -> float:
        self.failures.happened()
        raise self.errors[self.failures.count % len(self.errors)]("the database is down")


class ReportsRefused(MemoryStorage):
    """A storage that cannot take status reports (its database is down)."""

    def __init__(self, failures: Failures) -> None:
        super().__init__()
        self.failures = failures

    def report_status(self, report: StatusReport) -> None:
        self.failures.happened()
        raise StorageUnavailable("the database is down")


class BrokerDown(KombuTransport):
    """memory://, except that no connection to it can be made (the broker is down)."""

    def __init__(self, failures: Failures) -> None:
        super().__init__("memory://", reconnect_backoff=Backoff((0.001,)))
        self.failures = failures

    def _connect(self) -> Any:
        self.failures.happened()
        raise TransportUnavailable("cannot connect to the broker: it is down")


@dataclass
class Outage:
    """Something that keeps failing in a thread of its own, and where it says so."""

    failures: Failures
    throttle: Throttle
    logger: str
    start: Callable[[], None]
    stop: Callable[[], None]


def helper_thread(failures: Failures) -> Outage:
    thread = DatabaseDown(failures, StorageUnavailable)
    return Outage(failures, thread.outage_lines, "idembus.runtime.background", thread.start,
                  thread.stop)


def status_reports(failures: Failures) -> Outage:
    reporter = StatusReporter(ReportsRefused(failures), "sales", dict, interval=0.001)
    return Outage(failures, reporter.outage_lines, "idembus.runtime.status", reporter.start,
                  reporter.stop)


def consumer(failures: Failures) -> Outage:
    transport, stop = BrokerDown(failures), threading.Event()
    thread = threading.Thread(target=transport.consume, args=("sales", lambda d: None),
                              kwargs={"stop": stop}, daemon=True)

    def stopped() -> None:
        stop.set()
        if thread.ident is not None:
            thread.join(10)

    return Outage(failures, transport.reconnect_lines, "idembus.transports.kombu",
                  thread.start, stopped)


@pytest.fixture(params=[helper_thread, status_reports, consumer],
                ids=["helper-thread", "status-reports", "consumer"])
def outage(request: pytest.FixtureRequest) -> Iterator[Outage]:
    made: Outage = request.param(Failures())
    made.throttle.interval = 3600  # no second line until the test says so
    yield made
    made.stop()


def test_an_outage_that_lasts_is_one_line_per_interval_with_how_many_were_held_back(
    outage: Outage, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=outage.logger)

    def lines() -> list[str]:
        return [r.getMessage() for r in messages(caplog, outage.logger)]

    # When it fails 50 times in a row, a millisecond apart
    outage.start()
    assert outage.failures.wait_for(50)

    # Then it said so once
    assert len(lines()) == 1, lines()
    assert "down" in lines()[0] and "held back" not in lines()[0]

    # When the interval is over, the next line says how many were held back
    outage.throttle.interval = 0
    assert outage.failures.wait_for(outage.failures.count + 2)
    held = re.search(r"\((\d+) more such line\(s\) held back in 0s\)", lines()[1])
    assert held is not None, lines()
    assert int(held.group(1)) >= 45


def test_a_refusal_is_said_at_error_while_the_warnings_of_an_outage_are_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a helper thread whose database is down, and refuses its login in between
    caplog.set_level(logging.WARNING, logger="idembus.runtime.background")
    failures = Failures()
    thread = DatabaseDown(failures, StorageUnavailable, StorageAccessDenied)
    thread.outage_lines.interval = 3600
    thread.start()
    try:
        # When both keep happening
        assert failures.wait_for(50)
    finally:
        thread.stop()

    # Then each was said once: the ERROR of the refusal is not held back by the warnings
    levels = [r.levelno for r in messages(caplog, "idembus.runtime.background")]
    assert sorted(levels) == [logging.WARNING, logging.ERROR], levels
    assert "the database is down" in thread.health.problems().get(thread.name, "")


def test_json_lines_carry_the_message_fields_and_no_password() -> None:
    record = logging.LogRecord("idembus.runtime.processing", logging.WARNING, __file__, 1,
                               "moved %s: %s", ("m-1", "postgresql://app:Pw-Json@db/x down"),
                               None)
    record.endpoint, record.message_id, record.message_type = "sales", "m-1", "test.Deposit"
    record.handler = "AccountHandler"

    entry = json.loads(JsonFormatter().format(record))

    assert entry["level"] == "WARNING" and entry["logger"] == "idembus.runtime.processing"
    assert (entry["endpoint"], entry["message_id"], entry["message_type"], entry["handler"]) == (
        "sales", "m-1", "test.Deposit", "AccountHandler")
    assert "Pw-Json" not in json.dumps(entry)
    assert entry["time"].endswith("+00:00")


def test_idembus_run_writes_json_lines(tmp_path: pathlib.Path) -> None:
    (tmp_path / "json_app.py").write_text(textwrap.dedent("""
        from idembus import Endpoint
        from idembus.storage.memory import MemoryStorage
        from tests.support import AccountHandler

        def make():
            return Endpoint("json-app", storage=MemoryStorage(), handlers=[AccountHandler])
    """))
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", "run", "json_app:make", "--log-format", "json"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
        stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        first = json.loads(process.stderr.readline())
        while "started" not in first["message"]:
            first = json.loads(process.stderr.readline())
        assert first["endpoint"] == "json-app" and first["level"] == "INFO"
    finally:
        process.terminate()
        process.communicate(timeout=30)


#: A program that fails in every way Python reports by itself, each time with a password.
UNCAUGHT_PROGRAM = textwrap.dedent('''
    import sys
    import threading

    from idembus.logs import configure

    configure("INFO", sys.argv[1])


    def in_a_thread():
        raise RuntimeError("thread lost postgresql://app:Pw;In,Thread@db/x")


    class Leaky:
        def __del__(self):
            raise ValueError("__del__ lost host=db password=Pw;In)Del dbname=x")


    thread = threading.Thread(target=in_a_thread, name="courier")
    thread.start()
    thread.join()
    Leaky()
    raise ConnectionError("main lost amqp://guest:Pw;In'Main@broker//")
''')


@pytest.mark.parametrize("form", ["text", "json"])
def test_what_nothing_caught_is_logged_redacted_in_every_thread(
    tmp_path: pathlib.Path, form: str,
) -> None:
    (tmp_path / "uncaught.py").write_text(UNCAUGHT_PROGRAM)

    done = subprocess.run([sys.executable, "uncaught.py", form], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          timeout=60)

    output = done.stdout + done.stderr
    assert done.returncode == 1
    # Each failure is there, with its traceback, in the command's log format
    text = output.decode()
    for said in ("uncaught RuntimeError in thread courier", "Exception ignored in",
                 "uncaught ConnectionError: the command ends", "thread lost postgresql://",
                 "__del__ lost host=db password=***", "main lost amqp://guest:***@broker//"):
        assert said in text, text
    if form == "json":
        entries = [json.loads(line) for line in done.stderr.decode().splitlines()]
        assert {entry["level"] for entry in entries} == {"CRITICAL", "ERROR", "WARNING"}
        assert all("Traceback" in entry["exception"] for entry in entries)
    # And no piece of any password (the tracebacks quote the source lines too)
    for piece in (b"In,Thread", b"Thread@", b"In)Del", b"In'Main", b"Pw;"):
        assert piece not in output, text


# -- values from a message's sender (issue 24, finding 9) ---------------------------------


@pytest.mark.parametrize(("value", "logged"), [
    ("m-1", "m-1"),
    ("a b/c:d", "a b/c:d"),
    ("m-1\nFORGED line", "'m-1\\nFORGED line'"),
    ("\x1b[2Jcleared", "'\\x1b[2Jcleared'"),
    ("line\u2028separator", "'line\\u2028separator'"),
    ("x" * 201, "'" + "x" * 200 + "…' (201 characters)"),
    ("\n" * 300, "'" + "\\n" * 100 + "…' (300 characters)"),
])
def test_a_value_from_a_sender_is_logged_escaped_and_bounded(value: str, logged: str) -> None:
    assert loggable(value) == logged


def test_the_debug_lines_of_messages_escape_and_bound_ids_and_types(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: the id's newline started a line of its own, the type was written whole
    caplog.set_level(logging.DEBUG, logger="idembus.messages")
    signals = EndpointSignals("accounts")
    assert MessageLog(signals).connect()
    signals.emit("received", message_id="m-1\nFORGED line", message_type="t" * 70_000)
    [record] = caplog.records
    line = record.getMessage()
    assert "\n" not in line and len(line) < 500, line
    assert "(70000 characters)" in line
    assert json.loads(JsonFormatter().format(record))["message_type"].endswith(
        "(70000 characters)")


def test_a_receiver_that_raises_is_logged_and_the_others_still_receive(caplog):
    # Before: one ``Signal.send`` ran every receiver, so the first that raised kept the rest
    # (in blinker's set order) from seeing the signal.
    from idembus.signals import EndpointSignals

    signals = EndpointSignals("shop")
    seen: list[str] = []
    clumsy = [lambda sender, **details: 1 / 0 for _ in range(20)]
    for receiver in clumsy:
        signals.handled.connect(receiver)
    signals.handled.connect(lambda sender, **details: seen.append(details["message_id"]),
                            weak=False)

    async def too_late(sender: str, **details: Any) -> None:  # never awaited: refused
        seen.append("async")

    signals.handled.connect(too_late)
    with caplog.at_level(logging.ERROR, logger="idembus.signals"):
        signals.emit("handled", message_id="m-1")
    assert seen == ["m-1"]
    assert caplog.text.count("ZeroDivisionError") == 20
    assert "coroutine function" in caplog.text
