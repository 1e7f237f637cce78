"""`idembus outbox package.module:endpoint` runs the outbox relay alone; with
``--as NAME`` it sends what a renamed or retired endpoint left, and ``--list-stranded``
shows, per endpoint, what has waited too long."""

from __future__ import annotations

import datetime
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid
from collections.abc import Callable, Sequence

import psycopg
import pytest

from idembus import Endpoint
from idembus import headers as h
from idembus.cli import main
from idembus.envelope import Envelope, utc_now
from idembus.policies import OutboxPolicy
from idembus.storage.base import AggregateRecord, Storage
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.support import eventually

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOURS = datetime.timedelta(hours=1)


@pytest.mark.amqp
@pytest.mark.postgres
def test_the_dispatcher_alone_sends_what_a_crash_left_and_stops_on_sigterm(tmp_path):
    # Given a commit whose message was never dispatched (the process died in between)
    require_service(AMQP_URL, "RabbitMQ")
    require_service(POSTGRES_URL, "PostgreSQL")
    suffix = uuid.uuid4().hex[:10]
    prefix, queue = f"disp{suffix}", f"dispatched-{suffix}"
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.verify()
    transport = KombuTransport(AMQP_URL)
    transport.declare(queue)
    lost = Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit",
                     h.INTENT: "send"}, '{"account": "a", "amount": 1}', queue)
    storage.commit(storage.load("Account", "a", "H/m1"), key="H/m1", state={"n": 1},
                   outgoing=[lost])
    (tmp_path / "dispatch_app.py").write_text(textwrap.dedent(f'''
        from idembus import Endpoint, OutboxPolicy
        from idembus.storage.postgres import PostgresStorage
        from tests.support import AccountHandler

        endpoint = Endpoint("dispatch-{suffix}", transport={AMQP_URL!r},
                            storage=PostgresStorage({POSTGRES_URL!r}, table_prefix={prefix!r}),
                            handlers=[AccountHandler], error_queue="error-{suffix}",
                            outbox=OutboxPolicy(grace=0))
    '''))
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", "outbox", "dispatch_app:endpoint"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # When the dispatcher runs alone, Then the message arrives with its id
        deadline = time.monotonic() + 30
        arrived = None
        while arrived is None and time.monotonic() < deadline:
            arrived = transport.get(queue)  # another process: poll the queue
            if arrived is None:
                time.sleep(0.05)
        assert arrived is not None and arrived.headers[h.MESSAGE_ID] == lost.message_id
        # And the entry is marked (the mark follows the broker's confirm, in that process)
        while storage.undispatched(committed_before=_soon()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert storage.undispatched(committed_before=_soon()) == []

        # And SIGTERM stops it cleanly
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
        transport.delete_queue(queue)
        transport.close()
        storage.drop_tables()
        storage.close()


def _soon():  # type: ignore[no-untyped-def]
    import datetime

    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=1)


# -- --as NAME and --list-stranded ------------------------------------------------------------


class Recording(KombuTransport):
    """memory:// that notes the id of every message it sends (closing it keeps the notes)."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self.sent: list[str] = []

    def send(self, envelope: Envelope) -> None:
        self.sent.append(envelope.message_id)


def command_of(endpoint: str) -> Envelope:
    return Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit",
                     h.INTENT: "send", h.ORIGINATING_ENDPOINT: endpoint},
                    '{"account": "a", "amount": 1}', "billing-queue")


def left_behind(storage: Storage, aggregate_id: str, endpoint: str) -> Envelope:
    """An entry ``endpoint`` committed and never dispatched (its process died); its message."""
    message = command_of(endpoint)
    storage.commit(AggregateRecord("Account", aggregate_id), key=f"H/{aggregate_id}",
                   state={}, outgoing=[message])
    return message


def deferred_by(storage: Storage, endpoint: str, due: datetime.datetime) -> Envelope:
    """A delayed message ``endpoint`` deferred until ``due``, waiting in the storage."""
    message = command_of(endpoint).with_headers({h.DELIVER_AT: due.isoformat()})
    storage.schedule(message, due, owner=endpoint)
    return message


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[], Endpoint]], str]:
    """``app(make_endpoint)``: a module in ``sys.modules`` whose ``endpoint`` is that factory;
    returns the reference to give the command. The command's hooks for uncaught exceptions
    are put back afterwards."""
    for owner, name in ((sys, "excepthook"), (threading, "excepthook"),
                        (sys, "unraisablehook")):
        monkeypatch.setattr(owner, name, getattr(owner, name))

    def make(factory: Callable[[], Endpoint]) -> str:
        module_name = f"dispatcher_app_{uuid.uuid4().hex[:8]}"
        module = types.ModuleType(module_name)
        module.endpoint = factory  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module_name, module)
        return f"{module_name}:endpoint"

    return make


def run_until(argv: Sequence[str], done: Callable[[], bool]) -> tuple[int, bool]:
    """Run ``idembus *argv`` in this process until ``done()`` holds (15 s at most), then
    send it SIGTERM as an operator would; its exit status, and whether ``done()`` held."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # never this test's end
    returned = threading.Event()
    held: list[bool] = []

    def terminate_when_done() -> None:
        came = eventually(lambda: returned.is_set() or done(), timeout=15.0, interval=0.01)
        held.append(came and not returned.is_set())
        if not returned.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    terminator = threading.Thread(target=terminate_when_done, daemon=True)
    terminator.start()
    try:
        status = main(list(argv))
    finally:
        returned.set()
        terminator.join(30)
        signal.signal(signal.SIGTERM, previous)
    return status, bool(held and held[0])


def waiting(storage: Storage) -> set[tuple[str | None, str]]:
    """Which endpoints have entries or delayed messages waiting, whatever their age."""
    return {(o.endpoint, o.kind) for o in storage.overdue(utc_now() + HOURS)}


def test_as_sends_the_entries_and_delayed_messages_a_renamed_endpoint_left(
    app: Callable[[Callable[[], Endpoint]], str],
) -> None:
    # Given the storage of "sales", once called "old-sales": an entry and a delayed message
    # of old-sales that nobody sends any more, and billing's, which are not sales' business
    storage, transport = MemoryStorage(), Recording()
    entry = left_behind(storage, "a", "old-sales")
    delayed = deferred_by(storage, "old-sales", utc_now() - HOURS)
    left_behind(storage, "b", "billing")
    deferred_by(storage, "billing", utc_now() - HOURS)
    reference = app(lambda: Endpoint("sales", transport=transport, storage=storage,
                                     outbox=OutboxPolicy(grace=0)))

    # When the dispatcher of sales runs as old-sales until they are sent, then is stopped
    status, sent = run_until(
        ["outbox", reference, "--as", "old-sales"],
        lambda: waiting(storage) == {("billing", "entries"), ("billing", "delayed messages")})

    # Then old-sales' entry and delayed message went out with their ids, and only they
    assert sent and status == 0
    assert sorted(transport.sent) == sorted([entry.message_id, delayed.message_id])
    assert storage.load("Account", "a", "H/a").processed["H/a"].dispatched
    assert not storage.load("Account", "b", "H/b").processed["H/b"].dispatched


def test_as_may_be_given_once_for_each_endpoint_that_left_messages(
    app: Callable[[Callable[[], Endpoint]], str],
) -> None:
    # Given entries left by two endpoints that no longer run
    storage, transport = MemoryStorage(), Recording()
    first = left_behind(storage, "a", "old-sales")
    second = left_behind(storage, "b", "legacy-sales")
    reference = app(lambda: Endpoint("sales", transport=transport, storage=storage,
                                     outbox=OutboxPolicy(grace=0)))

    # When one dispatcher runs as both
    status, sent = run_until(
        ["outbox", reference, "--as", "old-sales", "--as", "legacy-sales"],
        lambda: waiting(storage) == set())

    # Then it sent both
    assert sent and status == 0
    assert sorted(transport.sent) == sorted([first.message_id, second.message_id])


def listing(capsys: pytest.CaptureFixture[str], reference: str, *options: str) -> list[str]:
    capsys.readouterr()
    assert main(["outbox", reference, "--list-stranded", *options]) == 0
    return capsys.readouterr().out.splitlines()


def test_list_stranded_shows_per_endpoint_what_has_waited_longer_than_an_hour(
    app: Callable[[Callable[[], Endpoint]], str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a storage where only recent work waits
    storage = MemoryStorage()
    reference = app(lambda: Endpoint("sales", transport="memory://", storage=storage))
    left_behind(storage, "fresh", "sales")
    deferred_by(storage, "sales", utc_now() - datetime.timedelta(minutes=5))

    # Then nothing is listed as stranded
    assert listing(capsys, reference) == ["nothing has waited longer than 1:00:00"]

    # Given three entries old-sales committed two hours ago and more, and a delayed message
    # of old-sales due for two hours
    then = (utc_now() - 2 * HOURS).replace(microsecond=0)
    with monkeypatch.context() as patched:
        for index, moment in enumerate((then - HOURS, then, then)):
            patched.setattr("idembus.storage.memory.utc_now", lambda moment=moment: moment)
            left_behind(storage, f"old-{index}", "old-sales")
    deferred_by(storage, "old-sales", then)

    # When the operator lists what is stranded
    lines = listing(capsys, reference)

    # Then old-sales' are there, counted and dated; sales' recent work is not
    assert lines[:2] == [
        f"old-sales: 3 entries waiting since {(then - HOURS).isoformat()}",
        f"old-sales: 1 delayed message due since {then.isoformat()}",
    ]
    assert not any(line.startswith("sales:") for line in lines)
    assert f"idembus outbox {reference} --as NAME" in lines[-1]

    # And any wait can be asked for: with none, sales' recent work is listed as well
    lines = listing(capsys, reference, "--stranded-after", "0")
    assert any(line.startswith("sales: 1 entry waiting since") for line in lines)
    assert any(line.startswith("sales: 1 delayed message due since") for line in lines)


@pytest.mark.postgres
def test_list_stranded_on_postgresql_counts_each_endpoints_old_entries(
    app: Callable[[Callable[[], Endpoint]], str], capsys: pytest.CaptureFixture[str],
) -> None:
    # Given two entries old-sales committed hours ago, and one of sales just now
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"ls{uuid.uuid4().hex[:10]}"
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.verify()
    try:
        left_behind(storage, "a", "old-sales")
        left_behind(storage, "b", "old-sales")
        left_behind(storage, "c", "sales")
        then = (utc_now() - 3 * HOURS).replace(microsecond=0)
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"UPDATE {prefix}_processed SET processed_at = %s + "
                          "(CASE aggregate_id WHEN 'a' THEN 0 ELSE 1 END) * interval '1 hour' "
                          "WHERE aggregate_id IN ('a', 'b')", (then,))
        reference = app(lambda: Endpoint(
            "sales", transport="memory://",
            storage=PostgresStorage(POSTGRES_URL, table_prefix=prefix)))

        # When the operator lists what is stranded
        lines = listing(capsys, reference)

        # Then the old ones are counted under old-sales, since the oldest; the new one not
        assert lines[0] == f"old-sales: 2 entries waiting since {then.isoformat()}"
        assert not any(line.startswith("sales:") for line in lines)
    finally:
        storage.drop_tables()
        storage.close()


def test_as_and_list_stranded_reject_what_makes_no_sense(
    app: Callable[[Callable[[], Endpoint]], str], capsys: pytest.CaptureFixture[str],
) -> None:
    reference = app(lambda: Endpoint("sales", transport="memory://", storage=MemoryStorage()))

    with pytest.raises(SystemExit):  # argparse: not both
        main(["outbox", reference, "--as", "old-sales", "--list-stranded"])
    assert main(["outbox", reference, "--as", " "]) == 2
    assert "--as" in capsys.readouterr().err
    assert main(["outbox", reference, "--list-stranded", "--stranded-after", "-1"]) == 2


def test_the_old_command_name_dispatcher_still_runs_the_outbox_relay(
    app: Callable[[Callable[[], Endpoint]], str], capsys: pytest.CaptureFixture[str],
) -> None:
    # Given an endpoint with an entry committed by old-sales two hours ago
    storage = MemoryStorage()
    reference = app(lambda: Endpoint("sales", transport="memory://", storage=storage))
    then = utc_now() - 2 * HOURS
    deferred_by(storage, "old-sales", then)

    # When the operator uses the command's old name
    capsys.readouterr()
    assert main(["dispatcher", reference, "--list-stranded"]) == 0

    # Then it is the same command as `idembus outbox`
    old = capsys.readouterr().out
    assert main(["outbox", reference, "--list-stranded"]) == 0
    assert old == capsys.readouterr().out and old.startswith("old-sales: 1 delayed message")
