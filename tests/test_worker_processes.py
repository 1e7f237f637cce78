"""The processes of ``idembus run --workers N``: the supervisor never builds the endpoint
(nor imports the application), each worker runs the ``--on-worker-start`` hook once and
then the factory, and is named ``idembus worker I/N ENDPOINT`` in ``ps``."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import pytest

from idembus.storage.postgres import PostgresStorage
from idembus.transports.postgres import PostgresTransport
from tests.conftest import POSTGRES_URL, require_service
from tests.test_workers import ROOT, App, Running, children, wait_until

APP = textwrap.dedent('''
    import json
    import os
    import pathlib

    from idembus import Endpoint
    from idembus.storage.postgres import PostgresStorage
    from idembus.transports.postgres import PostgresTransport
    from tests.support import AccountHandler

    MARKS = pathlib.Path(os.environ["APP_MARKS"])
    MARKS.joinpath(f"imported-{os.getpid()}").touch()
    SET_UP = []


    def setup(worker):
        SET_UP.append(worker.index)
        MARKS.joinpath(f"hook-{os.getpid()}").write_text(json.dumps(
            {"index": worker.index, "count": worker.count, "pid": worker.pid}))


    def make() -> Endpoint:
        MARKS.joinpath(f"factory-{os.getpid()}").write_text(json.dumps(SET_UP))
        return Endpoint(
            os.environ["APP_QUEUE"],
            transport=PostgresTransport(os.environ["APP_POSTGRES"],
                                        table_prefix=os.environ["APP_PREFIX"] + "q"),
            storage=PostgresStorage(os.environ["APP_POSTGRES"],
                                    table_prefix=os.environ["APP_PREFIX"]),
            handlers=[AccountHandler],
            error_queue=os.environ["APP_ERROR_QUEUE"],
        )
''')


@pytest.fixture
def app(tmp_path: pathlib.Path) -> Iterator[App]:
    """The application above in ``tmp_path``, its queues and state in tables of its own
    in PostgreSQL (no broker needed), dropped afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    (tmp_path / "marks").mkdir()
    (tmp_path / "worker_app.py").write_text(APP)
    prefix = f"tt{uuid.uuid4().hex[:10]}"
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    transport = PostgresTransport(POSTGRES_URL, table_prefix=f"{prefix}q")
    storage.migrate()
    transport.migrate()
    made = App(tmp_path, f"titled-{prefix}", f"titled-error-{prefix}", prefix,
               transport)  # type: ignore[arg-type]  # only stopped and dropped here
    try:
        yield made
    finally:
        for running in made.running:
            running.stop()
        transport.drop_tables()
        transport.close()
        storage.drop_tables()
        storage.close()


def marks(app: App, kind: str) -> dict[int, str]:
    """What the application wrote, by process id: ``imported``, ``hook`` or ``factory``."""
    return {int(path.name.split("-")[1]): path.read_text()
            for path in (app.directory / "marks").glob(f"{kind}-*")}


def started(app: App, *arguments: str) -> tuple[Running, list[int]]:
    """``idembus run worker_app:make --workers 2 ARGUMENTS`` once both workers consume."""
    supervisor = app.start("--workers", "2", *arguments,
                           APP_MARKS=str(app.directory / "marks"))
    assert supervisor.err.wait_for(", 1 consumer(s), ", count=2), supervisor.err.lines[-20:]
    workers = sorted(children(supervisor.process.pid))
    assert len(workers) == 2
    return supervisor, workers


def stop(supervisor: Running) -> None:
    supervisor.process.send_signal(signal.SIGTERM)
    assert supervisor.process.wait(timeout=60) == 0, supervisor.err.lines[-20:]


@pytest.mark.postgres
def test_the_supervisor_builds_nothing_and_ps_names_each_worker(app: App):
    # Given two workers of an endpoint
    supervisor, workers = started(app)

    # Then only the workers imported the application and called its factory: the
    # supervisor did neither (before: it called the factory too, to check the endpoint)
    assert sorted(marks(app, "imported")) == workers
    assert sorted(marks(app, "factory")) == workers

    # And ps shows each worker by its number and its endpoint, and top by its number
    # (before: "python -c import sys ...")
    titles = sorted(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
                    for pid in workers)
    assert titles == [f"idembus worker 1/2 {app.queue}", f"idembus worker 2/2 {app.queue}"]
    names = sorted(pathlib.Path(f"/proc/{pid}/comm").read_text().strip() for pid in workers)
    assert names == ["idembus w1/2", "idembus w2/2"]
    stop(supervisor)


@pytest.mark.postgres
def test_the_set_up_hook_runs_once_in_each_worker_before_the_factory(app: App):
    # Given two workers with a set-up hook
    supervisor, workers = started(app, "--on-worker-start", "worker_app:setup")

    # Then the hook ran once in each worker, told which worker it is, before the factory
    built = marks(app, "factory")
    hooks = {pid: json.loads(text) for pid, text in marks(app, "hook").items()}
    assert sorted(hooks) == workers
    assert sorted(hook["index"] for hook in hooks.values()) == [0, 1]
    for pid, hook in hooks.items():
        assert hook["count"] == 2 and hook["pid"] == pid
        assert json.loads(built[pid]) == [hook["index"]]

    # And a worker restarted after a crash is set up again, once
    os.kill(workers[0], signal.SIGKILL)
    assert supervisor.err.wait_for("exited with status -9"), supervisor.err.lines[-20:]
    assert wait_until(lambda: len(marks(app, "hook")) == 3 and len(marks(app, "factory")) == 3)
    assert supervisor.process.pid not in marks(app, "hook")
    stop(supervisor)


@pytest.mark.postgres
def test_a_hook_that_cannot_be_imported_is_a_configuration_error(app: App):
    done = app.start("--workers", "2", "--on-worker-start", "worker_app:no_such_function",
                     APP_MARKS=str(app.directory / "marks"))
    assert done.process.wait(timeout=60) == 2
    assert done.err.wait_for("no_such_function is not a function", timeout=5)
    assert marks(app, "factory") == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_without_setproctitle_the_name_top_shows_is_still_set() -> None:
    # setproctitle is optional: without it (its import fails), prctl names the process
    probe = textwrap.dedent('''
        import sys
        sys.modules["setproctitle"] = None  # as if it were not installed
        from idembus.cli.worker import WorkerProcess, set_title
        worker = WorkerProcess(1, 4)
        assert set_title(worker.title("orders"), worker.name)
        print(open("/proc/self/comm").read().strip())
    ''')
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "idembus w2/4"
    from idembus.cli.worker import WorkerProcess

    assert WorkerProcess(1, 4).title("orders") == "idembus worker 2/4 orders"
