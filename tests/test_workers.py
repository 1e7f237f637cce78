"""`idembus run --workers N`, graceful shutdown on SIGTERM, and killed workers."""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

import psycopg
import pytest

from idembus.cli.supervisor import Supervisor
from idembus.routing import Router
from idembus.sending import Bus
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.support import Deposit

pytestmark = [pytest.mark.amqp, pytest.mark.postgres]
ROOT = pathlib.Path(__file__).resolve().parent.parent

APP = textwrap.dedent('''
    import os
    import time

    from idembus import Endpoint
    from idembus.handlers import AggregateHandler, handles
    from idembus.storage.postgres import PostgresStorage
    from tests.support import Account, Deposit


    class Accounts(AggregateHandler[Account]):
        def aggregate_id(self, message: Deposit) -> str:
            return message.account

        @handles
        def deposit(self, message: Deposit) -> None:
            seconds = float(os.environ.get("APP_HANDLER_SECONDS", "0"))
            if seconds:
                print("started", message.account, flush=True)
                time.sleep(seconds)  # work that takes a while
            self.state.balance += message.amount
            self.state.deposits += 1
            if seconds:
                print("finished", message.account, flush=True)


    def make() -> Endpoint:
        return Endpoint(
            os.environ["APP_QUEUE"],
            transport=os.environ["APP_TRANSPORT"],
            storage=PostgresStorage(os.environ["APP_POSTGRES"],
                                    table_prefix=os.environ["APP_PREFIX"]),
            handlers=[Accounts],
            error_queue=os.environ["APP_ERROR_QUEUE"],
            prefetch=4,
        )
''')


class LineWatcher:
    """Reads a process's stream in a thread (closing it at the end); lets a test wait for
    lines."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                with self._changed:
                    self.lines.append(line.rstrip("\n"))
                    self._changed.notify_all()

    def wait_for(self, text: str, count: int = 1, timeout: float = 30.0) -> bool:
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(text in line for line in self.lines) >= count, timeout)

    def join(self) -> None:
        self._thread.join(timeout=30)


@dataclass
class Running:
    """An ``idembus run`` process and what it prints."""

    process: subprocess.Popen[str]
    out: LineWatcher
    err: LineWatcher

    def stop(self) -> None:
        """SIGTERM first (a supervisor killed outright would leave its workers to notice
        alone that it is gone), SIGKILL if that does not end it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        self.out.join()
        self.err.join()


@dataclass
class App:
    directory: pathlib.Path
    queue: str
    error_queue: str
    prefix: str
    transport: KombuTransport
    running: list[Running] = field(default_factory=list)

    def environment(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), "APP_QUEUE": self.queue,
                "APP_ERROR_QUEUE": self.error_queue, "APP_PREFIX": self.prefix,
                "APP_TRANSPORT": AMQP_URL, "APP_POSTGRES": POSTGRES_URL, **extra}

    def start(self, *arguments: str, command: tuple[str, ...] = (sys.executable, "-m", "idembus"),
              **extra: str) -> Running:
        """``idembus run worker_app:make ARGUMENTS`` (``command``: how idembus is started)."""
        process = subprocess.Popen(
            [*command, "run", "worker_app:make", *arguments],
            cwd=self.directory, env=self.environment(**extra), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert process.stdout is not None and process.stderr is not None
        started = Running(process, LineWatcher(process.stdout), LineWatcher(process.stderr))
        self.running.append(started)
        return started

    def send(self, deposit: Deposit, message_id: str | None = None) -> str:
        bus = Bus("test-sender", Router({Deposit: self.queue}), self.transport.dispatch)
        return bus.send(deposit, message_id=message_id)

    def accounts(self) -> dict[str, dict[str, int]]:
        with psycopg.connect(POSTGRES_URL) as connection:
            rows = connection.execute(
                f"SELECT aggregate_id, state FROM {self.prefix}_aggregates").fetchall()
        return {row[0]: row[1] for row in rows}


@contextlib.contextmanager
def deployed(directory: pathlib.Path, source: str, *, name: str = "workers",
             prefix: str = "wk") -> Iterator[App]:
    """An :class:`App` whose ``worker_app.py`` (in ``directory``) is ``source``, with queues
    and tables of its own (``name``, ``prefix`` and a random suffix), removed afterwards
    with whatever processes it started."""
    require_service(AMQP_URL, "RabbitMQ")
    require_service(POSTGRES_URL, "PostgreSQL")
    (directory / "worker_app.py").write_text(source)
    suffix = uuid.uuid4().hex[:10]
    transport = KombuTransport(AMQP_URL)
    made = App(directory, f"{name}-{suffix}", f"{name}-error-{suffix}", f"{prefix}{suffix}",
               transport)
    storage = PostgresStorage(POSTGRES_URL, table_prefix=made.prefix)
    storage.migrate()
    transport.declare(made.queue)
    try:
        yield made
    finally:
        for running in made.running:
            running.stop()
        for queue in (made.queue, made.error_queue):
            transport.delete_queue(queue)
        transport.close()
        storage.drop_tables()
        storage.close()


@pytest.fixture
def app(tmp_path: pathlib.Path) -> Iterator[App]:
    with deployed(tmp_path, APP) as made:
        yield made


def wait_until(predicate, timeout: float = 60.0) -> bool:
    """Poll another process's effects (there is no event to wait on across processes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def children(pid: int) -> list[int]:
    text = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def test_sigterm_lets_the_message_in_progress_finish_then_exits_0(app):
    # Given one worker busy with a deposit that takes a second
    worker = app.start("--shutdown-timeout", "20", APP_HANDLER_SECONDS="1")
    app.send(Deposit(account="a", amount=5))
    assert worker.out.wait_for("started a")

    # When it is told to stop
    worker.process.send_signal(signal.SIGTERM)

    # Then it finishes the deposit, acknowledges it and exits 0
    assert worker.process.wait(timeout=30) == 0
    assert worker.out.wait_for("finished a", timeout=5)
    assert app.accounts() == {"a": {"balance": 5, "deposits": 1}}
    assert app.transport.pending(app.queue) == 0


def test_several_workers_share_a_queue_survive_kills_and_apply_each_deposit_once(app):
    # Given three worker processes of one endpoint
    supervisor = app.start("--workers", "3", "--log-level", "INFO")
    log = supervisor.err
    assert log.wait_for(", 1 consumer(s), ", count=3), log.lines[-20:]

    # When 300 deposits arrive, 20% of them twice, while a worker is killed twice
    rng = random.Random(4)
    sent: dict[str, tuple[str, int]] = {}
    for number in range(300):
        account = f"acct-{number % 7}"
        message_id = str(uuid.uuid4())
        sent[message_id] = (account, number)
        app.send(Deposit(account=account, amount=number), message_id=message_id)
        if rng.random() < 0.2:
            app.send(Deposit(account=account, amount=number), message_id=message_id)
        if number in (100, 200):
            kills = 1 if number == 100 else 2
            os.kill(rng.choice(children(supervisor.process.pid)), signal.SIGKILL)
            # the next kill must find the replacement, not the dead worker
            assert log.wait_for("exited with status -9", count=kills), log.lines[-20:]
            assert log.wait_for(", 1 consumer(s), ", count=3 + kills), log.lines[-20:]

    # Then every deposit is applied exactly once
    expected: dict[str, dict[str, int]] = {}
    for account, amount in sent.values():
        state = expected.setdefault(account, {"balance": 0, "deposits": 0})
        state["balance"] += amount
        state["deposits"] += 1
    assert wait_until(lambda: app.accounts() == expected), app.accounts()
    assert wait_until(lambda: app.transport.pending(app.queue) == 0)
    assert app.transport.pending(app.error_queue) == 0

    # And the killed workers were replaced, and SIGTERM stops them all with status 0
    assert len(children(supervisor.process.pid)) == 3
    supervisor.process.send_signal(signal.SIGTERM)
    assert supervisor.process.wait(timeout=60) == 0, log.lines[-30:]


def test_workers_refuse_a_broker_or_database_that_lives_inside_one_process(app):
    done = app.start("--workers", "2", APP_TRANSPORT="memory://")
    assert done.process.wait(timeout=60) == 2
    assert done.err.wait_for("memory://, MemoryStorage and mongomock live inside one process",
                             timeout=5)


def test_workers_stop_by_themselves_when_their_supervisor_is_killed(app):
    # Given a supervisor of two workers
    supervisor = app.start("--workers", "2")
    assert supervisor.err.wait_for(", 1 consumer(s), ", count=2), supervisor.err.lines[-20:]
    workers = children(supervisor.process.pid)

    # When the supervisor is killed outright
    supervisor.process.kill()
    supervisor.process.wait()

    # Then its workers notice and exit instead of consuming unsupervised
    assert wait_until(lambda: not any(pathlib.Path(f"/proc/{pid}").exists() for pid in workers),
                      timeout=30), workers
    assert supervisor.err.wait_for("is gone; stopping this worker", count=2)


def test_a_users_modules_named_like_libraries_do_not_stand_in_for_them_in_workers(app):
    # Given files named like the libraries a worker imports, in the working directory (one
    # of them, pydantic, imported by `import idembus` itself)
    for name in ("psycopg", "kombu", "json", "pydantic"):
        (app.directory / f"{name}.py").write_text(
            f"raise ImportError('the user module {name}.py was imported')\n")

    # When two workers run there, supervised by the installed command (whose own sys.path
    # starts with its script's directory, not the working directory)
    installed = str(pathlib.Path(sys.executable).parent / "idembus")
    supervisor = app.start("--workers", "2", command=(installed,))

    # Then each worker imports the real libraries, and the workers handle a deposit
    log = supervisor.err
    assert log.wait_for(", 1 consumer(s), ", count=2), log.lines[-20:]
    app.send(Deposit(account="a", amount=3))
    assert wait_until(lambda: app.accounts() == {"a": {"balance": 3, "deposits": 1}})
    supervisor.process.send_signal(signal.SIGTERM)
    assert supervisor.process.wait(timeout=60) == 0, log.lines[-20:]
    assert not any("the user module" in line for line in log.lines), log.lines[-20:]


def test_a_worker_takes_the_working_directory_off_the_front_of_sys_path_on_any_python(
    tmp_path: pathlib.Path,
):
    # The worker's command does not depend on -P (Python 3.11+ only): start it as a worker
    # would, up to the point where it has imported the command line, and look
    command = Supervisor("app:make", workers=1).worker_command()
    assert "-P" not in command
    probe = command[2].replace("sys.exit(main())", "print(repr(sys.path[0]))")
    done = subprocess.run([command[0], "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr(str(ROOT))  # what came after the working directory
