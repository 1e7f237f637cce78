"""Logs an operator can read: what an endpoint is at start, what it did at stop, one DEBUG
line per message and handler, the traceback of a dead-lettered message, repeated outage
lines held back, and JSON lines for machines — every one redacted."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from idembus import RetryPolicy
from idembus.endpoint import _described
from idembus.handlers import handles
from idembus.logs import JsonFormatter, Throttle
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing import wait_until_idle
from idembus.transports.kombu import KombuTransport
from tests.support import AccountHandler, Deposit, SignalCounter

ROOT = pathlib.Path(__file__).resolve().parent.parent


def messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == logger]


def test_start_and_stop_say_what_the_endpoint_is_and_what_it_did(
    make_endpoint, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="idembus.endpoint")
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=MemoryStorage())
    handled = SignalCounter(accounts, "handled")

    accounts.start()
    accounts.bus.send(Deposit(account="a", amount=1))
    assert handled.wait_for(1)
    accounts.stop()

    lines = [record.getMessage() for record in messages(caplog, "idembus.endpoint")]
    started = next(line for line in lines if "started" in line)
    for part in (accounts.name, "AccountHandler", "1 consumer(s)", "KombuTransport",
                 "MemoryStorage"):
        assert part in started, started
    stopped = next(line for line in lines if "stopped" in line)
    assert "handled 1" in stopped and "received 1" in stopped
    # And a process-local storage is called what it is
    warnings = [r.getMessage() for r in messages(caplog, "idembus.endpoint")
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
    caplog.set_level(logging.WARNING, logger="idembus.processing")
    accounts = make_endpoint("accounts", handlers=[Refuses],
                             retry_policy=RetryPolicy(immediate_retries=0, delayed=()))
    dead = SignalCounter(accounts, "dead_lettered")
    with accounts:
        message_id = accounts.bus.send(Deposit(account="a", amount=1))
        assert dead.wait_for(1)
        wait_until_idle([accounts])

    [moved] = [r for r in messages(caplog, "idembus.processing") if "moved" in r.getMessage()]
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


def test_json_lines_carry_the_message_fields_and_no_password() -> None:
    record = logging.LogRecord("idembus.processing", logging.WARNING, __file__, 1,
                               "moved %s: %s", ("m-1", "postgresql://app:Pw-Json@db/x down"),
                               None)
    record.endpoint, record.message_id, record.message_type = "sales", "m-1", "test.Deposit"

    entry = json.loads(JsonFormatter().format(record))

    assert entry["level"] == "WARNING" and entry["logger"] == "idembus.processing"
    assert (entry["endpoint"], entry["message_id"], entry["message_type"]) == (
        "sales", "m-1", "test.Deposit")
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
