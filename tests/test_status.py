"""Endpoints report their counters to their storage; ``idembus status`` prints them.

The CLI runs in-process here, on a second endpoint object sharing the running endpoint's
storage: a :class:`~tests.test_cli_errors.SharedMemoryStorage`, shared in this test process
as a database is between processes (``idembus status`` refuses a process-local one).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import types

import pytest

from idembus import Endpoint
from idembus.cli import main
from idembus.cli.status import render, summarise
from idembus.storage.base import StatusReport
from idembus.storage.memory import MemoryStorage
from tests.support import AccountHandler, Deposit, SignalCounter
from tests.test_cli_errors import SharedMemoryStorage
from tests.test_failure_taxonomy import RefusedLoginForAWhile

NOW = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=datetime.timezone.utc)


@pytest.fixture
def exposed(monkeypatch: pytest.MonkeyPatch):
    """``exposed(endpoint)`` makes it reachable as ``status_app:endpoint`` for the CLI."""
    def expose(endpoint):  # type: ignore[no-untyped-def]
        module = types.ModuleType("status_app")
        module.endpoint = endpoint  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "status_app", module)
        return "status_app:endpoint"
    return expose


def wait_until(predicate, timeout: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    """Reports are written on a timer: look again until one says what we expect."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_running_endpoint_reports_its_counters_and_status_prints_them(
    make_endpoint, make_transport, exposed, capsys
):
    # Given an endpoint that reports every 50 ms and handled two deposits
    storage = SharedMemoryStorage()
    service = make_endpoint("status", handlers=[AccountHandler], storage=storage,
                            status_interval=0.05)
    handled = SignalCounter(service, "handled")
    service.start()
    service.bus.send(Deposit(account="a", amount=1))
    service.bus.send(Deposit(account="a", amount=1), message_id="same")
    service.bus.send(Deposit(account="a", amount=1), message_id="same")
    assert handled.wait_for(2)
    assert wait_until(lambda: any(r.counters.get("duplicate") == 1
                                  for r in storage.status_reports(service.name)))

    # When idembus status runs (its own Endpoint object, as in another process), as JSON
    # and as a table
    viewer = Endpoint(service.name, storage=storage, handlers=[AccountHandler],
                      transport=make_transport())
    assert main(["status", exposed(viewer), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert main(["status", exposed(viewer)]) == 0
    table = capsys.readouterr().out

    # Then it shows the one running process and its counters
    assert summary["running"] == 1
    assert summary["total"]["handled"] == 2
    assert summary["total"]["duplicate"] == 1
    assert summary["total"]["received"] == 3
    (instance,) = summary["instances"]
    assert instance["state"] == "running"
    assert f"endpoint {service.name}: 1 process(es) running" in table
    assert any(line.startswith("instance") and "handled" in line for line in table.splitlines())
    print(table)


def test_a_stopped_endpoint_leaves_a_last_report_marked_stopped(make_endpoint):
    storage = MemoryStorage()
    service = make_endpoint("status", handlers=[AccountHandler], storage=storage)
    handled = SignalCounter(service, "handled")
    service.start()
    service.bus.send(Deposit(account="a", amount=1))
    assert handled.wait_for(1)

    assert service.stop()

    (last,) = storage.status_reports(service.name)
    assert last.stopped and last.counters["handled"] == 1


def test_only_running_processes_count_in_the_total():
    def report(instance: str, age: float, handled: int, stopped: bool = False) -> StatusReport:
        return StatusReport("sales", instance, {"handled": handled}, NOW,
                            NOW - datetime.timedelta(seconds=age), stopped)

    summary = summarise("sales", [report("a", 1, 5), report("b", 100, 7),
                                  report("c", 1, 11, stopped=True)],
                        now=NOW, stale_after=datetime.timedelta(seconds=15))
    assert [i["state"] for i in summary["instances"]] == ["running", "stale", "stopped"]
    assert summary["running"] == 1 and summary["total"]["handled"] == 5
    assert "total (running)" in render(summary)


def test_status_shows_what_blocks_a_running_process_and_forgets_it_once_resolved(
    make_endpoint, exposed, capsys
):
    # Given an endpoint whose broker refuses its login (password in the URL it reports)
    storage = SharedMemoryStorage()
    transport = RefusedLoginForAWhile("memory://")
    service = make_endpoint("blocked", handlers=[AccountHandler], storage=storage,
                            transport=transport, status_interval=0.05)
    service.start()

    # When idembus status runs while the login is refused
    assert wait_until(lambda: any(r.problems for r in storage.status_reports(service.name)))
    viewer = Endpoint(service.name, storage=storage, handlers=[AccountHandler],
                      transport="memory://")
    assert main(["status", exposed(viewer)]) == 0
    table = capsys.readouterr().out

    # Then it names the problem of the running process, without the password
    assert "PROBLEM" in table and "(transport): " in table and "Login was refused" in table
    assert "hunter2" not in table

    # When the login works again, the problem is gone from the next report
    transport.allow.set()
    assert wait_until(lambda: all(not r.problems for r in storage.status_reports(service.name)))


def test_status_hides_processes_not_heard_of_for_an_hour_and_forgets_them_after_a_day(
    exposed, capsys
):
    # Given reports of a running process, one silent for two hours, one for two days
    storage = SharedMemoryStorage()
    now = datetime.datetime.now(datetime.timezone.utc)
    for instance, age in (("now", 0), ("hours", 2 * 3600), ("days", 2 * 86400)):
        moment = now - datetime.timedelta(seconds=age)
        storage.report_status(StatusReport("sales", instance, {"handled": 1}, moment, moment))
    viewer = Endpoint("sales", storage=storage, handlers=[AccountHandler],
                      transport="memory://")

    # When status runs
    assert main(["status", exposed(viewer), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)

    # Then only the recent one shows, the other one is counted as hidden, and the oldest
    # report is gone from the storage
    assert [i["instance"] for i in summary["instances"]] == ["now"]
    assert summary["hidden"] == 1
    assert {r.instance for r in storage.status_reports("sales")} == {"now", "hours"}
    assert main(["status", exposed(viewer), "--all", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["instances"]) == 2


@pytest.mark.parametrize("storage", ["memory", "mongomock"])
def test_status_refuses_a_storage_no_other_process_can_read_with_exit_2_and_the_reason(
    exposed, capsys, storage: str
):
    # Given an endpoint whose storage lives inside its process, with a report in it
    local = Endpoint("local", storage=MemoryStorage() if storage == "memory" else None,
                     handlers=[AccountHandler])
    local.storage.report_status(StatusReport("local", "here", {"handled": 1}, NOW, NOW))

    # When idembus status looks at it
    status = main(["status", exposed(local)])

    # Then it refuses in one line, instead of "0 process(es) running" for every endpoint
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert "storage of endpoint 'local'" in err
    assert "is process-local: another process cannot see its status reports" in err
    assert len(err.strip().splitlines()) == 1
