"""``--profile``: where the idembus flow spends its CPU, per message.

cProfile follows one thread only, and idembus works in its consumer threads (which also
publish). So each endpoint gets a :class:`ProfiledKombuTransport`, a KombuTransport whose
``consume`` runs under a profiler of its own; the profiles of both consumer threads are
merged. The profilers count **thread CPU time**, not wall time: with two busy threads
sharing the GIL, wall time charges a function that releases the GIL (``os.urandom``, a
socket read) with the time the *other* thread then held it, which misleads. Waiting for
the broker (confirms, deliveries) is therefore not in the figures; the run's wall time
per message is printed next to the CPU per message to show how much of it is waiting.

Two tables: the stages of one delivery (:data:`STAGES`), then the top 25 functions by
cumulative time; both divide by the 2N handled messages. cProfile's own overhead inflates
call-heavy code, so read proportions rather than absolute speed.
"""

from __future__ import annotations

import cProfile
import pstats
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench import idembus_flow
from idembus.transports.base import OnDelivery
from idembus.transports.kombu import KombuTransport

#: (file, line, function) -> (primitive calls, calls, own time, cumulative time, callers)
#: Prefixes cut from file names in the table.
_ROOTS = (str(Path(__file__).resolve().parents[1]) + "/", "site-packages/", "/lib/python")

StatsTable = dict[tuple[str, int, str], tuple[int, int, float, float, Any]]

#: (label, file name ending or path part, function name): the stages of one delivery.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("consumer threads, all CPU", "transports/kombu.py", "consume"),
    ("  one delivery (MessageProcessor)", "bus/processing.py", "__call__"),
    ("    decode + validate", "bus/decoding.py", "decode"),
    ("    invoke (load, run, commit)", "bus/invocation.py", "invoke"),
    ("      storage.load", "storage/", "load"),
    ("      handler run + state dump", "bus/invocation.py", "_run"),
    ("      storage.commit", "storage/", "commit"),
    ("    dispatch", "bus/processing.py", "_dispatch"),
    ("      transport publish", "transports/kombu.py", "_publish"),
    ("      storage.mark_dispatched", "storage/", "mark_dispatched"),
    ("    ack", "transports/base.py", "ack"),
    ("    signals (all emits)", "bus/signals.py", "emit"),
    ("  kombu message -> Delivery", "transports/kombu.py", "__init__"),
)


class ProfileSet:
    """The profilers of every consumer thread of one run (thread CPU time by default;
    ``timer=time.perf_counter`` for wall time)."""

    def __init__(self, timer: Callable[[], float] = time.thread_time) -> None:
        self._timer = timer
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def new(self) -> cProfile.Profile:
        profile = cProfile.Profile(self._timer)
        with self._lock:
            self._profiles.append(profile)
        return profile

    def merged(self) -> pstats.Stats:
        with self._lock:
            first, *others = self._profiles
        stats = pstats.Stats(first)
        for other in others:
            stats.add(other)
        return stats


class ProfiledKombuTransport(KombuTransport):
    """A KombuTransport whose consumer threads run under cProfile."""

    def __init__(self, url: str, *, profiles: ProfileSet, **options: Any) -> None:
        super().__init__(url, **options)
        self._profiles = profiles

    def consume(self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event,
                prefetch: int = 1) -> None:
        profile = self._profiles.new()
        profile.enable()
        try:
            super().consume(queue, on_delivery, stop=stop, prefetch=prefetch)
        finally:
            profile.disable()


def profiled_factory(profiles: ProfileSet) -> Callable[..., KombuTransport]:
    def factory(url: str, **options: Any) -> KombuTransport:
        return ProfiledKombuTransport(url, profiles=profiles, **options)

    return factory


def profile_run(url: str, storage: str, count: int, *, confirm: bool, top: int = 25) -> None:
    """Run the idembus flow once under cProfile and print the ``top`` cumulative rows."""
    profiles = ProfileSet()
    seconds = idembus_flow.run(url, storage, count, confirm=confirm,
                               transport=profiled_factory(profiles))
    messages = 2 * count
    table: StatsTable = profiles.merged().stats  # type: ignore[attr-defined]
    print(f"\nprofile: idembus on {url.split('://')[0]}, storage {storage}, confirms "
          f"{'on' if confirm else 'off'}: {messages} messages in {seconds:.2f}s under cProfile "
          f"({messages / seconds:.0f} msgs/s, {seconds / messages * 1e6:.0f} us wall/msg)")
    print(f"{'CPU us/msg':>10}  stage")
    for label, where, function in STAGES:
        print(f"{_cumulative(table, where, function) / messages * 1e6:>10.1f}  {label}")
    print(f"\ntop {top} by cumulative CPU:")
    print(f"{'calls':>9} {'own s':>8} {'cum s':>8} {'cum us/msg':>10}  function")
    for line in format_rows(_by_cumulative(table.items())[:top], messages):
        print(line)


def _cumulative(table: StatsTable, where: str, function: str) -> float:
    """Cumulative time of every function named ``function`` in a file matching ``where``."""
    return sum(entry[3] for (filename, _, name), entry in table.items()
               if name == function and where in filename.replace("\\", "/"))


def _by_cumulative(rows: Iterable[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    return sorted(rows, key=lambda row: row[1][3], reverse=True)


def format_rows(rows: Iterable[tuple[Any, Any]], messages: int) -> Iterable[str]:
    for (filename, line, function), (_, calls, own, cumulative, _) in rows:
        where = _short_path(filename)
        label = f"{where}:{line}({function})" if line else function
        yield (f"{calls:>9} {own:>8.3f} {cumulative:>8.3f} "
               f"{cumulative / messages * 1e6:>10.1f}  {label}")


def _short_path(filename: str) -> str:
    for marker in _ROOTS:
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename
