"""Shutdown never hangs: SIGINT and SIGTERM sent together, at any moment, to ``idembus run``
or to a ``--workers`` supervisor, end it within ``--shutdown-timeout`` + 5 s.

Before signal handlers only set a flag (``bus.shutdown``), handlers that called
``Event.set()`` re-entered its lock when the second signal arrived inside the first: 6 runs
in 20 hung here.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import Deposit
from tests.test_workers import App, LineWatcher, Running, app  # noqa: F401 (the fixture)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHUTDOWN_TIMEOUT = 5.0
#: How long after the signals every run must have ended.
ALLOWED = SHUTDOWN_TIMEOUT + 5.0
SINGLE_RUNS = 30
SUPERVISOR_RUNS = 10

EMBEDDED_APP = textwrap.dedent('''
    from idembus import Endpoint
    from idembus.storage.memory import MemoryStorage
    from tests.support import AccountHandler


    def make() -> Endpoint:
        return Endpoint("shutdown-test", handlers=[AccountHandler], storage=MemoryStorage())
''')


def _both_signals(process: subprocess.Popen[str]) -> float:
    """SIGINT and SIGTERM back to back; the time they were sent."""
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGTERM)
    return time.monotonic()


def _ended_in_time(process: subprocess.Popen[str], sent_at: float) -> bool:
    try:
        process.wait(timeout=max(0.0, sent_at + ALLOWED - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False
    return True


def _single_run(directory: pathlib.Path, moment: int) -> tuple[int, bool, int | None, str]:
    """One ``idembus run`` on memory:// signalled at ``moment``: 0..9 while it starts
    (that many tenths of a second after launch), 10 and up once it consumes."""
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", "run", "embedded_app:make",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)],
        cwd=directory, env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{directory}"},
        text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    log = LineWatcher(process.stderr)
    consuming = False
    if moment < 10:
        time.sleep(moment / 10)  # a moment during start-up, not a synchronisation
    else:
        consuming = log.wait_for("endpoint shutdown-test started", timeout=60)
    ended = _ended_in_time(process, _both_signals(process))
    log.join()
    return moment, ended, process.returncode if consuming else None, "\n".join(log.lines[-5:])


def test_idembus_run_signalled_twice_at_once_always_ends_in_time(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "embedded_app.py").write_text(EMBEDDED_APP)
    moments = [moment % 20 for moment in range(SINGLE_RUNS)]  # 10 while starting, 20 consuming

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda moment: _single_run(tmp_path, moment), moments))

    hung = [(moment, tail) for moment, ended, _, tail in results if not ended]
    assert not hung, f"{len(hung)} of {SINGLE_RUNS} runs did not end in time: {hung[:3]}"
    # A run signalled while consuming stopped cleanly (one signalled during start-up may die
    # of the signal before its handlers are in place: it held no message)
    unclean = [(moment, status, tail) for moment, _, status, tail in results
               if status not in (None, 0)]
    assert not unclean, unclean


@pytest.mark.amqp
@pytest.mark.postgres
def test_a_supervisor_signalled_twice_at_once_always_ends_in_time(app: App) -> None:  # noqa: F811
    statuses = []
    for run in range(SUPERVISOR_RUNS):
        # Given a supervisor of two workers, in half the runs with a deposit in progress
        busy = run % 2 == 1
        supervisor: Running = app.start(
            "--workers", "2", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--log-level",
            "INFO", APP_HANDLER_SECONDS="1" if busy else "0")
        assert supervisor.err.wait_for(", 1 consumer(s), ", count=2), (
            supervisor.err.lines[-20:])
        if busy:
            app.send(Deposit(account=f"run-{run}", amount=run))
            assert supervisor.out.wait_for(f"started run-{run}")

        # When SIGINT and SIGTERM reach the supervisor together
        sent_at = _both_signals(supervisor.process)

        # Then it and its workers end within the shutdown timeout and 5 s, cleanly
        assert _ended_in_time(supervisor.process, sent_at), (run, supervisor.err.lines[-20:])
        statuses.append(supervisor.process.returncode)
        supervisor.out.join()
        supervisor.err.join()
        app.running.remove(supervisor)

    assert statuses == [0] * SUPERVISOR_RUNS
    # And the deposits in progress were finished, not abandoned
    expected = {f"run-{run}": {"balance": run, "deposits": 1}
                for run in range(SUPERVISOR_RUNS) if run % 2 == 1}
    assert app.accounts() == expected
