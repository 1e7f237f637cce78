"""Two endpoint processes race for one schedule on PostgreSQL and RabbitMQ; the one holding
the scheduler's lease is killed (SIGKILL) mid-way. Every occurrence is handled exactly once:
none twice, none missed."""

from __future__ import annotations

import datetime
import os
import pathlib
import signal
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from idembus.runtime.scheduler import SCHEDULER_LEASE
from idembus.schedules import occurrence_id
from tests.conftest import POSTGRES_URL
from tests.schedules_race_app import SCHEDULE
from tests.test_workers import App, deployed, wait_until

pytestmark = [pytest.mark.amqp, pytest.mark.postgres]


@pytest.fixture
def race(tmp_path: pathlib.Path) -> Iterator[App]:
    with deployed(tmp_path, "from tests.schedules_race_app import make\n", name="race",
                  prefix="race") as made:
        yield made


def tallies(race: App) -> dict[datetime.datetime, dict[str, Any]]:
    """What the handler applied, by occurrence."""
    with psycopg.connect(POSTGRES_URL) as connection:
        rows = connection.execute(
            f"SELECT aggregate_id, state FROM {race.prefix}_aggregates "
            "WHERE aggregate_type = 'Tally'").fetchall()
    return {datetime.datetime.fromisoformat(row[0]): row[1] for row in rows}


def lease_holder(race: App) -> int | None:
    """The pid of the process holding the scheduler's lease now, if any."""
    with psycopg.connect(POSTGRES_URL) as connection:
        row = connection.execute(
            f"SELECT owner FROM {race.prefix}_leases WHERE name = %s AND expires_at > now()",
            (f"{SCHEDULER_LEASE}:{race.queue}",)).fetchone()
    return int(row[0].split(":")[1]) if row else None


def every_second_once(tallies: dict[datetime.datetime, dict[str, Any]], queue: str) -> bool:
    """Each second from the first occurrence to the newest handled exactly once, with the
    occurrence's own id."""
    if not tallies:
        return False
    first, last = min(tallies), max(tallies)
    seconds = int((last - first).total_seconds()) + 1
    return len(tallies) == seconds and all(
        tally["handled"] == 1 and tally["message_ids"] == [occurrence_id(queue, SCHEDULE, at)]
        for at, tally in tallies.items())


def test_two_processes_racing_for_a_schedule_handle_each_occurrence_once_across_a_kill(
    race: App,
) -> None:
    # Given two processes of one endpoint with an every-second schedule that catches up
    processes = [race.start(), race.start()]
    for process in processes:
        assert process.err.wait_for("schedules: tick", timeout=60), process.err.lines[-20:]
    assert wait_until(lambda: len(tallies(race)) >= 3, timeout=60), processes[0].err.lines

    # When the process holding the scheduler's lease is killed
    holder_pid = lease_holder(race)
    assert holder_pid in {p.process.pid for p in processes}
    killed = next(p for p in processes if p.process.pid == holder_pid)
    survivor = next(p for p in processes if p is not killed)
    os.kill(holder_pid, signal.SIGKILL)
    assert killed.process.wait(timeout=30) == -signal.SIGKILL
    killed_at = datetime.datetime.now(datetime.timezone.utc)

    # Then the survivor takes over and sends the following occurrences
    def survivor_sent(count: int) -> bool:
        return sum(1 for at, tally in tallies(race).items()
                   if tally["pid"] == survivor.process.pid and at > killed_at) >= count

    assert wait_until(lambda: survivor_sent(4), timeout=60), survivor.err.lines[-20:]

    # And every second from the first occurrence on was handled exactly once, with its id,
    # the seconds missed while the lease passed on included
    snapshot: dict[datetime.datetime, dict[str, Any]] = {}

    def complete() -> bool:
        snapshot.clear()
        snapshot.update(tallies(race))
        return every_second_once(snapshot, race.queue)

    assert wait_until(complete, timeout=30), sorted(
        (at.isoformat(), tally["handled"]) for at, tally in snapshot.items())
    builders = {tally["pid"] for tally in snapshot.values()}
    assert builders == {killed.process.pid, survivor.process.pid}
    assert all(tally["pid"] == survivor.process.pid
               for at, tally in snapshot.items() if at > killed_at)

    # And the survivor stops cleanly, nothing having gone to the error queue
    survivor.process.send_signal(signal.SIGTERM)
    assert survivor.process.wait(timeout=60) == 0, survivor.err.lines[-20:]
    assert all(tally["handled"] == 1 for tally in tallies(race).values())
    assert race.transport.pending(race.error_queue) == 0
