"""Shutdown never hangs: SIGINT and SIGTERM sent together, at any moment, to ``idembus run``,
to a ``--workers`` supervisor, to ``idembus gateway`` or to ``idembus dispatcher``, end it
within ``--shutdown-timeout`` + 5 s; signalled once running, it exits 0, and a message in
flight is finished first.

"Together" is two ``kill()`` calls back to back, in either order, so that the second signal
usually arrives while the first one's handler runs. Before signal handlers only set a flag
(``idembus.runtime.shutdown``), handlers that called ``Event.set()`` re-entered its lock when that
happened: 6 runs in 20 of ``idembus run`` hung here, 4 in 25 of ``idembus gateway``.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.support import Deposit
from tests.test_workers import App, LineWatcher, Running, app  # noqa: F401 (the fixture)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHUTDOWN_TIMEOUT = 5.0
#: How long after the signals every run must have ended.
ALLOWED = SHUTDOWN_TIMEOUT + 5.0
#: Each storm runs twice: reduced in make test, full-size in make soak (marked slow).
SOAK = [pytest.mark.slow, pytest.mark.timeout(600)]


def storm_sizes(*, reduced: int, full: int) -> list[Any]:
    """The numbers of runs of a storm, as the parameter ``runs``."""
    return [pytest.param(reduced, id="reduced"), pytest.param(full, id="full", marks=SOAK)]


#: What a handler of a message in flight takes (well within the shutdown timeout).
HANDLER_SECONDS = "0.5"

EMBEDDED_APP = textwrap.dedent('''
    import os
    import sys
    import time

    from idembus import Endpoint
    from idembus.handlers import AggregateHandler, handles
    from idembus.storage.memory import MemoryStorage
    from tests.support import Account, Deposit


    class SlowAccounts(AggregateHandler[Account]):
        def aggregate_id(self, message: Deposit) -> str:
            return message.account

        @handles
        def deposit(self, message: Deposit) -> None:
            say(f"started {message.account}")
            time.sleep(float(os.environ["APP_HANDLER_SECONDS"]))  # work that takes a while
            self.state.balance += message.amount
            say(f"finished {message.account}")


    def say(line: str) -> None:
        """One write: a line another thread prints (the gateway's banner) cannot split."""
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()


    def make() -> Endpoint:
        """With APP_IN_FLIGHT set, a deposit waits in the queue: it is in flight as soon
        as the endpoint consumes. APP_NAME, APP_TRANSPORT and APP_POSTGRES put it on a
        shared broker and database (the gateway refuses process-local ones)."""
        name = os.environ.get("APP_NAME") or "shutdown-test"
        storage = MemoryStorage()
        if os.environ.get("APP_POSTGRES"):
            from idembus.storage.postgres import PostgresStorage

            storage = PostgresStorage(os.environ["APP_POSTGRES"],
                                      table_prefix=name.replace("-", "_"))
        endpoint = Endpoint(name, handlers=[SlowAccounts], storage=storage,
                            transport=os.environ.get("APP_TRANSPORT") or "memory://",
                            routes={Deposit: name}, journal=True)
        if os.environ.get("APP_IN_FLIGHT"):
            endpoint.transport.declare(endpoint.name)
            endpoint.bus.send(Deposit(account="in-flight", amount=1))
        return endpoint
''')


def _both_signals(pid: int, run: int, *, group: bool = False) -> float:
    """SIGINT and SIGTERM back to back (SIGTERM first in odd runs), to the process or to
    its whole process group; the time they were sent."""
    first, second = (signal.SIGTERM, signal.SIGINT) if run % 2 else (signal.SIGINT,
                                                                      signal.SIGTERM)
    kill = os.killpg if group else os.kill
    kill(pid, first)
    kill(pid, second)
    return time.monotonic()


def _ended_in_time(process: subprocess.Popen[str], sent_at: float) -> bool:
    try:
        process.wait(timeout=max(0.0, sent_at + ALLOWED - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False
    return True


@dataclass(frozen=True)
class Outcome:
    """How one signalled run went."""

    run: int
    #: Signalled while starting (else once running).
    starting: bool
    ended: bool
    #: Its exit status if it was signalled once running (``None`` during start-up).
    status: int | None
    #: True if it had a message in flight when signalled.
    in_flight: bool
    finished: bool
    tail: str


def _signalled_run(directory: pathlib.Path, run: int, arguments: list[str], ready: str,
                   *, starting: bool, ready_on_stdout: bool = False,
                   in_flight: bool = False, app_env: dict[str, str] | None = None) -> Outcome:
    """``idembus ARGUMENTS`` on the embedded app, signalled with both signals: while
    ``starting`` (a few tenths of a second after launch, before or after its handlers are
    in place), else once ``ready`` shows in its stderr (its stdout: ``ready_on_stdout``)
    or, with a message ``in_flight``, once its handler started."""
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", *arguments, "--shutdown-timeout",
         str(SHUTDOWN_TIMEOUT)],
        cwd=directory, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{directory}",
             "APP_HANDLER_SECONDS": HANDLER_SECONDS, "APP_IN_FLIGHT": "1" if in_flight else "",
             **(app_env or {})})
    assert process.stdout is not None and process.stderr is not None
    out, err = LineWatcher(process.stdout), LineWatcher(process.stderr)
    running = False
    if starting:
        time.sleep(run % 10 / 10)  # a moment during start-up, not a synchronisation
    elif in_flight:
        running = out.wait_for("started in-flight", timeout=60)
    else:
        running = (out if ready_on_stdout else err).wait_for(ready, timeout=60)
    ended = _ended_in_time(process, _both_signals(process.pid, run))
    out.join()
    err.join()
    return Outcome(run, starting, ended, process.returncode if running else None, in_flight,
                   "finished in-flight" in out.lines, "\n".join(err.lines[-5:]))


def _signal_many(directory: pathlib.Path, runs: int,
                 signalled: Callable[[pathlib.Path, int], Outcome]) -> list[Outcome]:
    (directory / "embedded_app.py").write_text(EMBEDDED_APP)
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda run: signalled(directory, run), range(runs)))


def _assert_all_ended_cleanly(outcomes: list[Outcome]) -> None:
    hung = [(o.run, o.tail) for o in outcomes if not o.ended]
    assert not hung, f"{len(hung)} of {len(outcomes)} runs did not end in time: {hung[:3]}"
    # A run signalled once running stopped cleanly (one signalled during start-up may die
    # of the signal before its handlers are in place: it held no message)
    unclean = [(o.run, o.status, o.tail) for o in outcomes if o.status not in (None, 0)]
    assert not unclean, unclean
    never_ready = [(o.run, o.tail) for o in outcomes if not o.starting and o.status is None]
    assert not never_ready, never_ready
    abandoned = [o.run for o in outcomes if o.in_flight and not o.finished]
    assert not abandoned, f"messages in flight abandoned in runs {abandoned}"


@pytest.mark.parametrize("runs", storm_sizes(reduced=6, full=30))
def test_idembus_run_signalled_twice_at_once_always_ends_in_time(
    tmp_path: pathlib.Path, runs: int,
) -> None:
    # Given runs of one endpoint (30 in the soak): a third signalled while starting, the
    # others once consuming, half of these with a message in flight
    def signalled(directory: pathlib.Path, run: int) -> Outcome:
        starting = run < runs // 3
        return _signalled_run(directory, run, ["run", "embedded_app:make"],
                              "endpoint shutdown-test started", starting=starting,
                              in_flight=not starting and run % 2 == 1)

    # When each gets SIGINT and SIGTERM at once
    outcomes = _signal_many(tmp_path, runs, signalled)

    # Then each ended in time, cleanly, its message finished
    _assert_all_ended_cleanly(outcomes)


@pytest.mark.amqp
@pytest.mark.postgres
@pytest.mark.parametrize("runs", storm_sizes(reduced=3, full=15))
def test_idembus_gateway_signalled_twice_at_once_always_ends_in_time(
    tmp_path: pathlib.Path, unique: str, runs: int,
) -> None:
    # Given gateways on PostgreSQL (a gateway refuses a process-local storage; 15 in the
    # soak): a third signalled while starting, a third while serving, a third that also
    # consume from RabbitMQ with a message in flight
    require_service(POSTGRES_URL, "PostgreSQL")
    require_service(AMQP_URL, "RabbitMQ")
    names = [f"shutdown-gw-{unique}-{run}" for run in range(runs)]

    def signalled(directory: pathlib.Path, run: int) -> Outcome:
        starting = run < runs // 3
        consume = not starting and run % 2 == 1
        return _signalled_run(
            directory, run, ["gateway", "embedded_app:make", "--listen", "127.0.0.1:0",
                             *(["--consume"] if consume else [])],
            f"idembus gateway: {names[run]} on http://", starting=starting,
            ready_on_stdout=True, in_flight=consume,
            app_env={"APP_NAME": names[run], "APP_POSTGRES": POSTGRES_URL,
                 "APP_TRANSPORT": AMQP_URL if consume else "memory://"})

    # When each gets SIGINT and SIGTERM at once, Then each ended in time and cleanly
    try:
        _assert_all_ended_cleanly(_signal_many(tmp_path, runs, signalled))
    finally:
        _drop(names)


def _drop(names: list[str]) -> None:
    """Remove the runs' queues and tables."""
    from idembus.storage.postgres import PostgresStorage
    from idembus.transports.kombu import KombuTransport

    transport = KombuTransport(AMQP_URL)
    try:
        for name in names:
            transport.delete_queue(name)
            storage = PostgresStorage(POSTGRES_URL, table_prefix=name.replace("-", "_"))
            try:
                storage.drop_tables()
            finally:
                storage.close()
    finally:
        transport.close()


@pytest.mark.parametrize("runs", storm_sizes(reduced=3, full=15))
def test_idembus_outbox_signalled_twice_at_once_always_ends_in_time(
    tmp_path: pathlib.Path, runs: int,
) -> None:
    # Given dispatchers running alone (15 in the soak): a third signalled while starting,
    # the others once running
    def signalled(directory: pathlib.Path, run: int) -> Outcome:
        return _signalled_run(directory, run, ["outbox", "embedded_app:make"],
                              "outbox relay of shutdown-test running alone",
                              starting=run < runs // 3)

    # When each gets SIGINT and SIGTERM at once, Then each ended in time and cleanly
    _assert_all_ended_cleanly(_signal_many(tmp_path, runs, signalled))


def _start_supervisor(app: App, busy: bool) -> Running:  # noqa: F811
    """``idembus run --workers 2`` in a process group of its own (as a terminal or a
    service manager starts it), so that a signal can reach the workers too."""
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", "run", "worker_app:make", "--workers", "2",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--log-level", "INFO"],
        cwd=app.directory, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=app.environment(APP_HANDLER_SECONDS=HANDLER_SECONDS if busy else "0"),
        start_new_session=True)
    assert process.stdout is not None and process.stderr is not None
    running = Running(process, LineWatcher(process.stdout), LineWatcher(process.stderr))
    app.running.append(running)
    return running


@pytest.mark.amqp
@pytest.mark.postgres
@pytest.mark.parametrize("runs", storm_sizes(reduced=4, full=10))
def test_a_supervisor_signalled_twice_at_once_always_ends_in_time(
    app: App, runs: int,  # noqa: F811
) -> None:
    statuses = []
    for run in range(runs):
        # Given a supervisor of two workers, in half the runs with a deposit in progress
        busy = run % 2 == 1
        supervisor = _start_supervisor(app, busy)
        assert supervisor.err.wait_for(", 1 consumer(s), ", count=2), (
            "\n".join(supervisor.err.lines[-40:]))
        if busy:
            app.send(Deposit(account=f"run-{run}", amount=run))
            assert supervisor.out.wait_for(f"started run-{run}")

        # When SIGINT and SIGTERM reach it together — in some runs its workers too, as
        # Ctrl-C in a terminal and a service manager's stop do
        group = run % 4 >= 2
        sent_at = _both_signals(supervisor.process.pid, run, group=group)

        # Then it and its workers end within the shutdown timeout and 5 s, cleanly
        assert _ended_in_time(supervisor.process, sent_at), (run, supervisor.err.lines[-20:])
        statuses.append(supervisor.process.returncode)
        supervisor.out.join()
        supervisor.err.join()
        app.running.remove(supervisor)

    assert statuses == [0] * runs
    # And the deposits in progress were finished, not abandoned
    expected = {f"run-{run}": {"balance": run, "deposits": 1}
                for run in range(runs) if run % 2 == 1}
    assert app.accounts() == expected
