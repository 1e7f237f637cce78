"""The dashboard's hour of per-minute figures: what the status reports' counters grew by
between two reads, put in the minute of the read; handling-time buckets kept by every
endpoint and read back as percentiles; memory bounded to sixty minutes."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest

from idembus import Endpoint
from idembus.dashboard.history import MINUTES, History, Sampler
from idembus.runtime.timings import BOUNDS_MS, KEYS, SLOWER, HandlingTimes, bucket_key, percentile
from idembus.signals import EndpointSignals
from idembus.storage.base import StatusReport
from idembus.storage.memory import MemoryStorage
from tests.support import AccountHandler, Deposit, SignalCounter

T0 = datetime.datetime(2026, 11, 23, 10, 0, 20, tzinfo=datetime.timezone.utc)


def report(instance: str, started: datetime.datetime, **counters: int) -> StatusReport:
    return StatusReport(endpoint="shop", instance=instance, counters=counters,
                        started_at=started, updated_at=started)


def minutes_later(minutes: float) -> datetime.datetime:
    return T0 + datetime.timedelta(minutes=minutes)


def test_what_the_counters_grew_by_between_reads_goes_to_the_minute_of_the_read() -> None:
    # Given an instance that started before the dashboard, with 40 handled already
    sampler = Sampler(since=T0)
    before = T0 - datetime.timedelta(minutes=5)
    sampler.sample([report("h:1:a", before, handled=40, received=41)], T0)
    # When it reports 43, then 50 a minute later
    sampler.sample([report("h:1:a", before, handled=43, received=44)], minutes_later(0.5))
    sampler.sample([report("h:1:a", before, handled=50, received=52)], minutes_later(1))
    # Then the hour holds 3 in the first minute and 7 in the next; the 40 from before the
    # dashboard started belong to no minute
    handled = sampler.history.series("handled", minutes_later(1))
    assert handled[-2:] == [3, 7]
    assert sum(handled) == 10
    assert sampler.history.series("received", minutes_later(1))[-2:] == [3, 8]


def test_an_instance_that_started_after_the_dashboard_counts_from_zero() -> None:
    sampler = Sampler(since=T0)
    sampler.sample([report("h:2:b", minutes_later(0.1), handled=5, dead_lettered=1)],
                   minutes_later(0.2))
    assert sampler.history.series("handled", minutes_later(0.2))[-1] == 5
    assert sampler.history.series("dead_lettered", minutes_later(0.2))[-1] == 1


def test_the_instances_of_an_endpoint_add_up_and_a_counter_that_restarts_counts_again() -> None:
    sampler = Sampler(since=T0)
    early = T0 - datetime.timedelta(hours=1)
    sampler.sample([report("h:1:a", early, failed=10), report("h:2:b", early, failed=1)], T0)
    sampler.sample([report("h:1:a", early, failed=12), report("h:2:b", early, failed=4)],
                   minutes_later(0.3))
    assert sampler.history.series("failed", minutes_later(0.3))[-1] == 5
    # A report whose counter went down (it cannot within one process) counts from zero
    sampler.sample([report("h:1:a", early, failed=2)], minutes_later(0.4))
    assert sampler.history.series("failed", minutes_later(0.4))[-1] == 7


def test_the_history_keeps_sixty_minutes_and_no_more() -> None:
    history = History()
    for minute in range(3 * MINUTES):
        history.add(minutes_later(minute), {"handled": 1, "not_charted": 9})
    assert len(history) == MINUTES
    series = history.series("handled", minutes_later(3 * MINUTES - 1))
    assert series == [1] * MINUTES
    assert history.series("not_charted", minutes_later(3 * MINUTES - 1)) == [0] * MINUTES
    # An hour later with nothing new, the hour is empty
    assert sum(history.series("handled", minutes_later(4 * MINUTES))) == 0


def test_a_percentile_is_read_back_from_the_buckets_by_interpolation() -> None:
    counts = {bucket_key(BOUNDS_MS.index(10)): 50, bucket_key(BOUNDS_MS.index(100)): 50}
    # Half the deliveries took 5-10 ms, half 50-100 ms
    assert percentile(counts, 0.5) == pytest.approx(10.0)
    assert percentile(counts, 0.25) == pytest.approx(7.5)
    assert percentile(counts, 0.99) == pytest.approx(99.0)
    assert percentile({}, 0.5) is None
    assert percentile({SLOWER: 3}, 0.5) == BOUNDS_MS[-1]


def test_percentiles_per_minute_come_from_the_buckets_reported() -> None:
    sampler = Sampler(since=T0)
    fast, slow = bucket_key(0), bucket_key(BOUNDS_MS.index(1000))
    sampler.sample([report("h:1:a", minutes_later(0.1), **{fast: 99, slow: 1})],
                   minutes_later(0.2))
    sampler.sample([report("h:1:a", minutes_later(0.1), **{fast: 99, slow: 101})],
                   minutes_later(1.2))
    p50 = sampler.history.percentiles(0.5, minutes_later(1.2))
    assert p50[-2] is not None and p50[-2] <= 1.0
    assert p50[-1] is not None and 500 < p50[-1] <= 1000
    assert p50[0] is None  # nothing handled then


def test_handling_times_count_only_handled_deliveries_in_their_bucket() -> None:
    times = HandlingTimes()
    endpoint = SimpleNamespace(signals=EndpointSignals("shop"))
    times.setup(endpoint)
    for outcome in ("handled", "dead_lettered", "retrying", None):
        endpoint.signals.emit("settled", message_id="m", message_type="t", outcome=outcome,
                              seconds=0.0004, time_sent=None)
    times.record(7.0)
    times.record(120_000.0)
    snapshot = times.snapshot()
    assert list(snapshot) == list(KEYS)
    assert sum(snapshot.values()) == 3
    assert snapshot[bucket_key(BOUNDS_MS.index(10))] == 1
    assert snapshot[SLOWER] == 1
    assert snapshot[bucket_key(0)] == 1  # the handled one, 0.4 ms
    times.close()  # and it stops watching
    endpoint.signals.emit("settled", outcome="handled", seconds=0.0004)
    assert times.snapshot() == snapshot


def test_an_endpoint_reports_its_handling_time_buckets_with_its_counters() -> None:
    storage = MemoryStorage()
    with Endpoint("timed", storage=storage, handlers=[AccountHandler],
                  status_interval=0.05) as endpoint:
        handled = SignalCounter(endpoint, "handled")
        endpoint.bus.send(Deposit(account="a", amount=1))
        endpoint.bus.send(Deposit(account="b", amount=1))
        assert handled.wait_for(2)
        endpoint.stop()
    [final] = storage.status_reports("timed")
    assert final.stopped
    assert final.counters["handled"] == 2
    assert sum(final.counters[key] for key in KEYS) == 2
