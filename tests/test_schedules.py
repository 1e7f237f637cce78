"""Recurring messages: ``Endpoint(schedules=[Schedule(...)])`` sends each occurrence once.

The scheduler reads the time from the endpoint's clock: most tests drive a fake one and
call ``run_once`` themselves, and see what went to the broker through a transport that
records what it dispatches.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from typing import Any

import pytest

from idembus import Command, ConfigurationError, Endpoint, Event, OutboxPolicy
from idembus import headers as h
from idembus.envelope import Envelope, format_utc
from idembus.handlers import Handler, handles
from idembus.runtime.scheduler import CATCH_UP_BATCH, SKIP_SCAN, Scheduler, read_state
from idembus.schedules import (
    SCHEDULE_NAMESPACE,
    Schedule,
    SchedulerPolicy,
    occurrence_id,
)
from idembus.storage.memory import MemoryStorage
from idembus.testing.contract.base import eager_switching
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.support import SignalCounter
from tests.test_third_party_storage import DictStorage

UTC = datetime.timezone.utc


class RunRollup(Command, message_name="sched.RunRollup"):
    pass


class RollupFor(Command, message_name="sched.RollupFor"):
    day: str


class HourStruck(Event, message_name="sched.HourStruck"):
    pass


class Rollups(Handler):
    """Handles the scheduled commands; remembers what it handled."""

    def __init__(self) -> None:
        self.handled: list[tuple[str, str | None]] = []

    @handles
    def run(self, message: RunRollup) -> None:
        self.handled.append((self.context.message_id, self.context.headers.get(h.OCCURRENCE)))

    @handles
    def rollup_for(self, message: RollupFor) -> None:
        self.handled.append((self.context.message_id, message.day))


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, at: datetime.datetime) -> None:
        self.at = at

    def now(self) -> datetime.datetime:
        return self.at

    def advance(self, **delta: float) -> None:
        self.at += datetime.timedelta(**delta)


class Recording(KombuTransport):
    """memory://, remembering every envelope dispatched; ``away`` makes sends fail as if
    the broker were down."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self.sent: list[Envelope] = []
        self.away = False
        self._lock = threading.Lock()

    def dispatch(self, envelope: Envelope) -> None:
        if self.away:
            raise TransportUnavailable("the broker is away (simulated)")
        with self._lock:
            self.sent.append(envelope)


def at(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text).replace(tzinfo=UTC)


def scheduled(schedule: Schedule, *, clock: FakeClock, storage: Any = None,
              transport: Recording | None = None, name: str = "reports",
              **options: Any) -> Endpoint:
    options.setdefault("status_interval", 0)
    return Endpoint(name, storage=storage if storage is not None else MemoryStorage(),
                    transport=transport or Recording(), handlers=[Rollups()], clock=clock,
                    schedules=[schedule], **options)


def sent(endpoint: Endpoint) -> list[Envelope]:
    transport = endpoint.transport
    assert isinstance(transport, Recording)
    return transport.sent


def occurrences_sent(endpoint: Endpoint) -> list[str]:
    return [envelope.headers[h.OCCURRENCE] for envelope in sent(endpoint)]


def scheduler_of(endpoint: Endpoint) -> Scheduler:
    assert endpoint.scheduler is not None
    return endpoint.scheduler


# -- configuration ------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "says"), [
    ({"cron": "61 * * * *"}, "'61 * * * *' is not a cron expression (Bad minute); write five"),
    ({"cron": "0 2 * *"}, "is not a cron expression (Wrong number of fields)"),
    ({"cron": "0 0 */20 * 1L"}, "'0 0 */20 * 1L' never occurs"),
    ({"cron": 5}, "cron must be a string such as '0 2 * * *'"),
    ({"timezone": "Europe/Rigaa"}, "unknown time zone 'Europe/Rigaa'; write an IANA name"),
    ({"timezone": "../etc/passwd"}, "unknown time zone '../etc/passwd'"),
    ({"name": "nightly/rollup"}, "schedule name 'nightly/rollup' must be 1 to 100 letters"),
    ({"name": ""}, "schedule name '' must be"),
    ({"name": "n" * 101}, "must be 1 to 100 letters"),
    ({"message": RunRollup}, "got the class RunRollup: pass an instance such as RunRollup(...)"),
    ({"message": "RunRollup"}, "message must be a Command or an Event instance, or a function"),
    ({"catch_up": "yes"}, "catch_up must be True or False, got 'yes'"),
], ids=["bad-field", "four-fields", "never", "not-text", "unknown-zone", "zone-path",
        "slash-in-name", "empty-name", "long-name", "message-class", "message-text",
        "catch-up-text"])
def test_a_bad_schedule_is_refused_at_construction_saying_what_to_write(
    options: dict[str, Any], says: str
) -> None:
    arguments: dict[str, Any] = {"name": "nightly", "cron": "0 2 * * *",
                                 "message": RunRollup(), **options}
    with pytest.raises(ConfigurationError, match=None) as refused:
        Schedule(arguments.pop("name"), **arguments)
    assert says in str(refused.value)


def test_two_schedules_of_one_name_are_refused_by_the_endpoint() -> None:
    twice = [Schedule("nightly", cron="0 2 * * *", message=RunRollup()),
             Schedule("nightly", cron="0 3 * * *", message=RunRollup())]
    with pytest.raises(ConfigurationError, match="two schedules named 'nightly'"):
        Endpoint("reports", storage=MemoryStorage(), handlers=[Rollups()], schedules=twice)


def test_a_scheduled_command_without_a_route_is_refused_with_the_route_to_add() -> None:
    with pytest.raises(ConfigurationError) as refused:
        Endpoint("reports", storage=MemoryStorage(), schedules=[
            Schedule("nightly", cron="0 2 * * *", message=RunRollup())])
    assert "add routes={RunRollup: '<endpoint name>'}" in str(refused.value)
    # routed elsewhere, or handled here, it is accepted
    Endpoint("reports", storage=MemoryStorage(), routes={RunRollup: "rollups"},
             schedules=[Schedule("nightly", cron="0 2 * * *", message=RunRollup())])


@pytest.mark.parametrize("schedules", [["0 2 * * *"], "nightly",
                                       SchedulerPolicy((), lease_ttl=0)],
                         ids=["not-schedules", "text", "zero-lease"])
def test_schedules_that_are_not_schedules_are_refused(schedules: Any) -> None:
    with pytest.raises(ConfigurationError, match="schedules must be a list of Schedule|"
                                                 "lease_ttl must be positive"):
        Endpoint("reports", storage=MemoryStorage(), schedules=schedules)


def test_a_storage_without_leases_is_refused_for_schedules_even_without_the_outbox() -> None:
    with pytest.raises(ConfigurationError) as refused:
        Endpoint("reports", storage=DictStorage(), outbox=False, status_interval=0,
                 handlers=[Rollups()],
                 schedules=[Schedule("nightly", cron="0 2 * * *", message=RunRollup())])
    assert "schedules=... needs (the scheduler's lease)" in str(refused.value)


# -- occurrences, time zones and daylight saving time ----------------------------------

def test_occurrence_ids_derive_from_the_endpoint_the_schedule_and_the_time_in_utc() -> None:
    riga = datetime.datetime(2026, 11, 20, 2, 0, tzinfo=Schedule(
        "n", cron="0 2 * * *", message=RunRollup(), timezone="Europe/Riga").zone)
    expected = str(uuid.uuid5(SCHEDULE_NAMESPACE,
                              "reports/nightly/2026-11-20T00:00:00+00:00"))
    assert occurrence_id("reports", "nightly", riga) == expected
    assert occurrence_id("reports", "nightly", riga.astimezone(UTC)) == expected
    assert occurrence_id("billing", "nightly", riga) != expected


def test_a_daily_job_in_the_hour_skipped_in_spring_runs_once_right_after_the_change() -> None:
    # Europe/Berlin skips 02:00-03:00 on 29 March 2026
    daily = Schedule("d", cron="30 2 * * *", message=RunRollup(), timezone="Europe/Berlin")
    found = list(daily.due(at("2026-03-28T12:00:00"), at("2026-03-31T12:00:00"), limit=10)[0])
    assert found == [at("2026-03-29T01:00:00"),   # 03:00 CEST, right after the change
                     at("2026-03-30T00:30:00"), at("2026-03-31T00:30:00")]


def test_a_daily_job_in_the_hour_repeated_in_autumn_runs_once_and_hourly_ones_twice() -> None:
    # Europe/Berlin goes through 02:00-03:00 twice on 25 October 2026
    daily = Schedule("d", cron="30 2 * * *", message=RunRollup(), timezone="Europe/Berlin")
    found = daily.due(at("2026-10-24T12:00:00"), at("2026-10-26T12:00:00"), limit=10)[0]
    assert found == [at("2026-10-25T00:30:00"), at("2026-10-26T01:30:00")]
    half_hourly = Schedule("h", cron="*/30 2 * * *", message=RunRollup(),
                           timezone="Europe/Berlin")
    found = half_hourly.due(at("2026-10-24T23:59:00"), at("2026-10-25T03:00:00"), limit=10)[0]
    assert found == [at("2026-10-25T00:00:00"), at("2026-10-25T00:30:00"),  # CEST
                     at("2026-10-25T01:00:00"), at("2026-10-25T01:30:00")]  # CET


@pytest.mark.parametrize(("start", "end", "expected"), [
    ("2026-03-28T12:00:00", "2026-03-30T12:00:00",
     ["2026-03-29T01:00:00+00:00", "2026-03-30T00:30:00+00:00"]),
    ("2026-10-24T12:00:00", "2026-10-26T12:00:00",
     ["2026-10-25T00:30:00+00:00", "2026-10-26T01:30:00+00:00"]),
], ids=["spring-forward", "fall-back"])
def test_the_scheduler_sends_a_daily_job_once_a_day_across_a_dst_change(
    start: str, end: str, expected: list[str]
) -> None:
    # Given a daily job at 02:30 in Berlin, its scheduler looking every 15 minutes
    clock = FakeClock(at(start))
    reports = scheduled(Schedule("nightly", cron="30 2 * * *", message=RunRollup(),
                                 timezone="Europe/Berlin"), clock=clock)
    while clock.now() < at(end):
        scheduler_of(reports).run_once()
        clock.advance(minutes=15)
    # Then one message a day went out, at the instants above, with their ids
    assert occurrences_sent(reports) == expected
    assert [e.message_id for e in sent(reports)] == [
        occurrence_id("reports", "nightly", at(text[:19])) for text in expected]


# -- the scheduler ------------------------------------------------------------------------

def test_the_first_start_sends_nothing_for_the_past_then_each_occurrence_once() -> None:
    # Given a nightly schedule first seen at 01:59:30 (its past nights never sent)
    clock = FakeClock(at("2026-11-20T01:59:30"))
    reports = scheduled(Schedule("nightly", cron="0 2 * * *", message=RunRollup()),
                        clock=clock)
    assert scheduler_of(reports).run_once() == 0
    assert sent(reports) == []

    # When 02:00 comes, and the scheduler looks again and again
    clock.advance(seconds=30)
    assert scheduler_of(reports).run_once() == 1
    assert scheduler_of(reports).run_once() == 0
    clock.advance(hours=1)
    assert scheduler_of(reports).run_once() == 0

    # Then the command went out once, to the endpoint's queue, with the occurrence's id
    [envelope] = sent(reports)
    assert envelope.destination == "reports"
    assert envelope.message_type == "sched.RunRollup"
    assert envelope.message_id == occurrence_id("reports", "nightly", at("2026-11-20T02:00:00"))
    assert envelope.headers[h.SCHEDULE] == "nightly"
    assert envelope.headers[h.OCCURRENCE] == "2026-11-20T02:00:00+00:00"
    assert envelope.headers[h.ORIGINATING_ENDPOINT] == "reports"
    assert reports.counters["schedule_fired"] == 1
    state = read_state(reports.storage, "reports", "nightly")
    assert state is not None
    assert (state.sent, state.skipped, state.failed) == (1, 0, 0)
    assert state.last_sent == at("2026-11-20T02:00:00")
    # And it is marked dispatched: nothing is left for the outbox
    assert reports.storage.undispatched(committed_before=at("2100-01-01T00:00:00")) == []


def test_occurrences_missed_while_nothing_ran_are_skipped_counted_and_the_newest_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given an every-minute schedule that ran once, then nothing ran for ten minutes
    clock = FakeClock(at("2026-11-20T10:00:30"))
    reports = scheduled(Schedule("minutely", cron="* * * * *", message=RunRollup()),
                        clock=clock)
    scheduler_of(reports).run_once()
    clock.advance(minutes=10)

    # When the scheduler looks again
    with caplog.at_level(logging.WARNING, logger="idembus.runtime.scheduler"):
        assert scheduler_of(reports).run_once() == 1

    # Then nine were skipped (counted, logged) and the newest was sent
    assert occurrences_sent(reports) == ["2026-11-20T10:10:00+00:00"]
    assert reports.counters["schedule_skipped"] == 9
    state = read_state(reports.storage, "reports", "minutely")
    assert state is not None and state.skipped == 9
    assert "skipped 9 occurrence(s) missed while no scheduler ran (2026-11-20T10:01:00+00:00 " \
           "to 2026-11-20T10:09:00+00:00)" in caplog.text


def test_catch_up_sends_every_missed_occurrence_in_order_a_bounded_batch_per_round() -> None:
    # Given an every-minute schedule that catches up, and 250 minutes missed
    clock = FakeClock(at("2026-11-20T10:00:30"))
    reports = scheduled(Schedule("minutely", cron="* * * * *", message=RunRollup(),
                                 catch_up=True), clock=clock)
    scheduler = scheduler_of(reports)
    scheduler.run_once()
    clock.advance(minutes=250)

    # When it makes its rounds
    rounds = []
    while True:
        count = len(sent(reports))
        wait = scheduler.round()
        rounds.append(len(sent(reports)) - count)
        if wait:
            break

    # Then it sent all 250, oldest first, 100 per round, the next round at once
    assert rounds == [CATCH_UP_BATCH, CATCH_UP_BATCH, 50]
    expected = [format_utc(at("2026-11-20T10:01:00") + datetime.timedelta(minutes=n))
                for n in range(250)]
    assert occurrences_sent(reports) == expected
    assert reports.counters["schedule_skipped"] == 0


def test_a_gap_longer_than_the_scan_jumps_to_the_newest_occurrence_at_once() -> None:
    # Given an every-second schedule down for a day (86,400 missed)
    clock = FakeClock(at("2026-11-20T10:00:00.5"))
    reports = scheduled(Schedule("secondly", cron="* * * * * *", message=RunRollup()),
                        clock=clock)
    scheduler_of(reports).run_once()
    clock.advance(days=1)

    started = time.monotonic()
    assert scheduler_of(reports).run_once() == 1
    # Then it sent the newest, having counted only the scan, in well under a round's time
    assert time.monotonic() - started < 10
    assert occurrences_sent(reports) == ["2026-11-21T10:00:00+00:00"]
    assert reports.counters["schedule_skipped"] == SKIP_SCAN


def test_a_restart_continues_from_the_stored_record_and_sends_a_missed_night_late() -> None:
    storage = MemoryStorage()
    schedule = Schedule("nightly", cron="0 2 * * *", message=RunRollup())
    clock = FakeClock(at("2026-11-20T01:00:00"))
    first = scheduled(schedule, clock=clock, storage=storage)
    scheduler_of(first).run_once()
    clock.advance(hours=1)
    assert scheduler_of(first).run_once() == 1
    first.close()

    # When the process is down from 01:55 to 02:10 the next night, then started again
    clock.at = at("2026-11-21T02:10:00")
    again = scheduled(schedule, clock=clock, storage=storage)
    assert scheduler_of(again).run_once() == 1
    assert scheduler_of(again).run_once() == 0

    # Then that night's occurrence was sent, late, once; the first one not again
    assert occurrences_sent(again) == ["2026-11-21T02:00:00+00:00"]


def test_a_message_function_builds_each_occurrences_message_from_its_time() -> None:
    clock = FakeClock(at("2026-11-20T21:00:00"))

    def rollup(occurrence: datetime.datetime) -> RollupFor:
        return RollupFor(day=(occurrence - datetime.timedelta(days=1)).date().isoformat())

    reports = scheduled(Schedule("daily", cron="0 0 * * *", message=rollup,
                                 timezone="America/New_York"), clock=clock)
    scheduler_of(reports).run_once()
    clock.advance(hours=8)  # past midnight in New York (05:00 UTC)
    scheduler_of(reports).run_once()
    [envelope] = sent(reports)
    assert envelope.body == '{"day":"2026-11-20"}'
    assert envelope.headers[h.OCCURRENCE] == "2026-11-21T05:00:00+00:00"


def test_an_event_schedule_is_published_to_its_subscribers() -> None:
    clock = FakeClock(at("2026-11-20T10:59:59"))
    reports = scheduled(Schedule("hourly", cron="0 * * * *", message=HourStruck()),
                        clock=clock)
    scheduler_of(reports).run_once()
    clock.advance(seconds=1)
    scheduler_of(reports).run_once()
    [envelope] = sent(reports)
    assert envelope.destination is None
    assert envelope.intent is h.Intent.PUBLISH
    assert envelope.message_type == "sched.HourStruck"


def test_an_occurrence_whose_message_cannot_be_built_fails_alone_and_is_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a message function that fails on the first night, and returns junk on the second
    clock = FakeClock(at("2026-11-20T01:00:00"))
    nights = iter([RuntimeError("no data for 2026-11-20 at postgresql://u:secret@db/x"),
                   "not a message", RunRollup()])

    def flaky(occurrence: datetime.datetime) -> RunRollup:
        result = next(nights)
        if isinstance(result, Exception):
            raise result
        return result  # type: ignore[return-value]

    reports = scheduled(Schedule("nightly", cron="0 2 * * *", message=flaky), clock=clock)
    scheduler = scheduler_of(reports)
    scheduler.run_once()

    # When the first night comes
    clock.advance(hours=1)
    with caplog.at_level(logging.ERROR, logger="idembus.runtime.scheduler"):
        assert scheduler.run_once() == 0
        assert scheduler.run_once() == 0  # not tried again

    # Then it is recorded as failed, logged, counted and shown in the health, password hidden
    state = read_state(reports.storage, "reports", "nightly")
    assert state is not None and (state.sent, state.failed) == (0, 1)
    assert state.last_error is not None and "secret" not in state.last_error
    assert "RuntimeError: no data for 2026-11-20" in state.last_error
    assert "the occurrence at 2026-11-20T02:00:00+00:00 failed and will not be tried" \
        in caplog.text
    assert "secret" not in caplog.text
    assert reports.counters["schedule_failed"] == 1
    assert "schedule nightly" in reports.health.problems()

    # And a function returning something else fails its night too, and the third goes out
    clock.advance(days=1)
    assert scheduler.run_once() == 0
    clock.advance(days=1)
    assert scheduler.run_once() == 1
    state = read_state(reports.storage, "reports", "nightly")
    assert state is not None and (state.sent, state.failed) == (1, 2)
    assert "TypeError" in (state.last_error or "")
    assert occurrences_sent(reports) == ["2026-11-22T02:00:00+00:00"]
    assert reports.health.problems() == {}


def test_a_crash_after_the_commit_is_sent_by_the_outbox_once_with_the_occurrence_id() -> None:
    # Given the broker goes away right after an occurrence was committed
    clock = FakeClock(at("2026-11-20T01:59:00"))
    transport = Recording()
    reports = scheduled(Schedule("nightly", cron="0 2 * * *", message=RunRollup()),
                        clock=clock, transport=transport, outbox=OutboxPolicy(grace=0))
    scheduler = scheduler_of(reports)
    scheduler.run_once()
    clock.advance(minutes=1)
    transport.away = True
    with pytest.raises(TransportUnavailable):
        scheduler.run_once()

    # When the broker is back: the scheduler does not send it again, the outbox does
    transport.away = False
    assert scheduler.run_once() == 0
    assert transport.sent == []
    assert reports.outbox.run_once() == 1
    assert reports.outbox.run_once() == 0

    # Then it went out once, with the id of its occurrence
    assert [e.message_id for e in transport.sent] == [
        occurrence_id("reports", "nightly", at("2026-11-20T02:00:00"))]


def test_one_scheduler_holds_the_lease_and_another_takes_over_when_it_lapses() -> None:
    storage = MemoryStorage()
    schedule = Schedule("minutely", cron="* * * * *", message=RunRollup())
    clock = FakeClock(at("2026-11-20T10:00:50"))
    policy = SchedulerPolicy([schedule], lease_ttl=30)
    one, two = (Endpoint("reports", storage=storage, transport=Recording(),
                         handlers=[Rollups()], clock=clock, schedules=policy,
                         status_interval=0) for _ in range(2))
    scheduler_of(one).run_once()
    clock.advance(seconds=10)

    # While the first holds the lease, the second sends nothing
    assert scheduler_of(two).run_once() == 0
    assert scheduler_of(two).lease is None
    assert scheduler_of(one).run_once() == 1  # 10:01, and the lease renewed to 10:01:30

    # When the first stops renewing, the second takes over once the lease's 30 s are over
    clock.advance(seconds=29)
    assert scheduler_of(two).run_once() == 0
    clock.advance(seconds=31)
    assert scheduler_of(two).run_once() == 1
    assert scheduler_of(two).lease is not None

    # And the first, back from its pause, is refused the lease and sends nothing
    assert scheduler_of(one).run_once() == 0
    assert occurrences_sent(one) == ["2026-11-20T10:01:00+00:00"]
    assert occurrences_sent(two) == ["2026-11-20T10:02:00+00:00"]


def test_two_schedulers_deciding_at_the_same_moment_send_each_occurrence_once(
    storage_factory: Any,
) -> None:
    # Given two processes' schedulers of one endpoint on one storage, past their leases
    # (paused holders both waking up): only the conditional write keeps them apart
    storage = storage_factory()
    schedule = Schedule("minutely", cron="* * * * *", message=RunRollup(), catch_up=True)
    clock = FakeClock(at("2026-11-20T10:00:30"))
    endpoints = [Endpoint("reports", storage=storage, transport=Recording(),
                          handlers=[Rollups()], clock=clock, schedules=[schedule],
                          status_interval=0) for _ in range(2)]
    schedulers = [scheduler_of(endpoint) for endpoint in endpoints]
    schedulers[0].run_once()

    # When for 20 minutes both decide each minute at the same moment
    barrier = threading.Barrier(2)
    totals = [0, 0]

    def decide(index: int) -> None:
        barrier.wait()
        totals[index] += schedulers[index]._run(schedule, clock.now())

    with eager_switching():
        for _ in range(20):
            clock.advance(minutes=1)
            threads = [threading.Thread(target=decide, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)

    # Then each of the 20 occurrences went out exactly once, whichever sent it
    everything = sent(endpoints[0]) + sent(endpoints[1])
    assert sum(totals) == 20
    assert sorted(e.headers[h.OCCURRENCE] for e in everything) == [
        format_utc(at("2026-11-20T10:01:00") + datetime.timedelta(minutes=n))
        for n in range(20)]
    state = read_state(storage, "reports", "minutely")
    assert state is not None and state.sent == 20


def test_a_running_endpoint_handles_its_own_schedule_and_stop_releases_the_lease() -> None:
    # Given an endpoint on the wall clock with an every-second schedule of its own command
    storage = MemoryStorage()
    rollups = Rollups()
    reports = Endpoint("reports", storage=storage, handlers=[rollups], status_interval=0,
                       schedules=[Schedule("secondly", cron="* * * * * *",
                                           message=RunRollup())])
    handled = SignalCounter(reports, "handled")
    with reports:
        assert handled.wait_for(2, timeout=15)
        lease = scheduler_of(reports).lease
        assert lease is not None
    # Then its handler got the occurrences with their ids, and the lease is free again
    message_id, occurrence = rollups.handled[0]
    assert occurrence is not None
    assert message_id == occurrence_id("reports", "secondly",
                                       datetime.datetime.fromisoformat(occurrence))
    assert storage.acquire_lease(lease.name, "someone else", ttl=30,
                                 now=datetime.datetime.now(UTC)) is not None


def test_stop_interrupts_the_wait_for_a_far_occurrence() -> None:
    # Given a running scheduler whose next round is minutes away (a yearly schedule)
    reports = Endpoint("reports", storage=MemoryStorage(), handlers=[Rollups()],
                       status_interval=0, outbox=False,
                       schedules=SchedulerPolicy([Schedule("yearly", cron="0 0 1 1 *",
                                                           message=RunRollup())],
                                                 lease_ttl=600))
    scheduler = scheduler_of(reports)
    waits: list[float] = []
    rounded = threading.Event()
    one_round = scheduler.round

    def noted_round() -> float:
        waits.append(one_round())
        rounded.set()
        return waits[-1]

    scheduler.round = noted_round  # type: ignore[method-assign]
    reports.start()
    assert rounded.wait(10)
    assert waits == [300.0]

    # When the endpoint stops, then the wait ends at once
    started = time.monotonic()
    assert reports.stop(timeout=10)
    assert time.monotonic() - started < 5
