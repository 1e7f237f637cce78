"""One ``/metrics`` for a supervised group of workers (``idembus run --workers N
--metrics-port P``).

The supervisor builds no endpoint and has no instruments of its own: each worker writes
its metrics to a file of its own (:mod:`idembus.observability.metrics_snapshots`), at most
a second old, and on every scrape the supervisor reads the files of its running workers
and serves their sum:

* counters and histograms (every bucket, ``_sum`` and ``_count``) are added up over the
  workers, under the labels the workers gave them: one series for the group, as
  Prometheus would show one process;
* everything else — the gauges (``idembus_messages_in_flight``, ``process_*``,
  ``target_info``...) — is a value per process, served once per worker with the labels
  ``worker`` (its index, from 0) and ``pid``.

A worker that exits, however it ends (SIGKILL included), leaves its last snapshot: the
supervisor adds its counters and histograms to those of the workers that exited before, and
drops its gauges. Its replacement writes to a new file, starting from 0. So the group's
counters never go backwards while the supervisor runs: what a worker counted in the last
second before SIGKILL (after its last snapshot) is not counted — the messages it was
processing then are redelivered and counted by the worker that handles them — and a
restarted supervisor starts every counter from 0 again, which Prometheus's ``rate()`` reads
as a counter reset.

prometheus_client's multiprocess mode was not used: it counts prometheus_client's own
metric classes in memory-mapped files, while idembus's instruments are OpenTelemetry's,
read through the OpenTelemetry Prometheus exporter's collector, which it does not serve.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..errors import ConfigurationError
from .metrics_snapshots import METRICS_FILE
from .prometheus import STOP_TIMEOUT, check_port, missing_extra, serve_registry

log = logging.getLogger(__name__)

#: Metric types whose samples add up over the workers.
ADDED = frozenset({"counter", "histogram", "summary"})
#: Samples that do not add up: creation times, and a summary's quantiles (label).
_CREATED = "_created"
_QUANTILE = "quantile"

Labels = tuple[tuple[str, str], ...]


@dataclass
class Family:
    """One metric family: its type, help and samples, ``(sample name, labels) -> value``."""

    name: str
    type: str
    documentation: str
    unit: str = ""
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)

    def like(self) -> Family:
        """An empty family of the same name, type and help."""
        return Family(self.name, self.type, self.documentation, self.unit)


def parse(text: str) -> list[Family]:
    """The families of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    families: list[Family] = []
    for metric in text_string_to_metric_families(text):
        family = Family(metric.name, metric.type, metric.documentation, metric.unit or "")
        for sample in metric.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            family.samples[key] = sample.value
        families.append(family)
    return families


def add(total: dict[str, Family], families: Iterable[Family]) -> None:
    """Add the counters and histograms of ``families`` to ``total`` (by family name);
    ignore the rest, and a family whose type differs from the one ``total`` has."""
    for family in families:
        if family.type not in ADDED:
            continue
        into = total.setdefault(family.name, family.like())
        if into.type != family.type:
            continue
        for key, value in family.samples.items():
            name, labels = key
            if name.endswith(_CREATED) or any(label == _QUANTILE for label, _ in labels):
                continue
            into.samples[key] = into.samples.get(key, 0.0) + value


def per_process(total: dict[str, Family], families: Iterable[Family],
                labels: Mapping[str, str]) -> None:
    """Add the families of ``families`` that do not add up (gauges and the like) to
    ``total``, each sample with ``labels`` added to its own."""
    for family in families:
        if family.type in ADDED:
            continue
        into = total.setdefault(family.name, family.like())
        if into.type != family.type:
            continue
        for (name, own), value in family.samples.items():
            merged = tuple(sorted({**dict(own), **labels}.items()))
            into.samples[(name, merged)] = value


def metrics(families: Iterable[Family]) -> Iterator[Any]:
    """``families`` as prometheus_client metric families, their samples in a stable order
    (a histogram's buckets together, by label set, in ascending ``le``)."""
    from prometheus_client.metrics_core import Metric

    for family in families:
        metric = Metric(family.name, family.documentation, family.type, family.unit)
        for (name, labels), value in sorted(family.samples.items(), key=_order):
            metric.add_sample(name, dict(labels), value)
        yield metric


def _order(item: tuple[tuple[str, Labels], float]) -> tuple[Any, ...]:
    (name, labels), _ = item
    rest = tuple(pair for pair in labels if pair[0] != "le")
    bound = dict(labels).get("le")
    return (rest, name, float(bound) if bound is not None else 0.0)


@dataclass
class _Running:
    path: pathlib.Path
    pid: int | None = None


class GroupMetrics:
    """The metrics of a group of workers, from the files they write to ``directory`` (see
    the module docstring). The supervisor tells it when a worker is :meth:`starting` (and
    gives the worker the environment it returns), :meth:`started` and :meth:`exited`;
    :meth:`collect` is a prometheus_client collector."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = pathlib.Path(directory)
        self._running: dict[int, _Running] = {}
        #: Counters and histograms of the workers that exited.
        self._exited: dict[str, Family] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def starting(self, index: int) -> dict[str, str]:
        """Worker ``index`` is about to start: the environment telling it where to write."""
        with self._lock:
            self._generation += 1
            path = self.directory / f"worker-{index}-{self._generation}.prom"
            self._running[index] = _Running(path)
        return {METRICS_FILE: str(path)}

    def started(self, index: int, pid: int) -> None:
        """Worker ``index`` runs as process ``pid``."""
        with self._lock:
            if index in self._running:
                self._running[index].pid = pid

    def exited(self, index: int) -> None:
        """Worker ``index`` has exited: keep its counters and histograms, drop the rest."""
        with self._lock:
            running = self._running.pop(index, None)
            if running is None:
                return
            add(self._exited, self._read(running.path))
            running.path.unlink(missing_ok=True)

    def collect(self) -> Iterator[Any]:
        """The group's metric families (prometheus_client's collector protocol)."""
        with self._lock:
            total = {name: _copy(family) for name, family in self._exited.items()}
            for index, running in sorted(self._running.items()):
                families = self._read(running.path)
                add(total, families)
                per_process(total, families, {"worker": str(index),
                                              "pid": str(running.pid or "")})
        return metrics(total.values())

    def _read(self, path: pathlib.Path) -> list[Family]:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return []  # not written yet
        except OSError as error:
            log.warning("cannot read a worker's metrics from %s: %s", path, error)
            return []
        try:
            return parse(text)
        except ValueError as error:
            log.warning("a worker's metrics in %s do not parse: %s", path, error)
            return []


def _copy(family: Family) -> Family:
    copied = family.like()
    copied.samples.update(family.samples)
    return copied


class GroupMetricsServer:
    """Serves the :class:`GroupMetrics` of a supervisor's workers at
    ``http://HOST:PORT/metrics`` (``port`` 0: a free one), from a directory of its own
    that :meth:`stop` removes. Checks at start that the workers will have the prometheus
    extra, and fails with a :class:`~idembus.errors.ConfigurationError` when the port
    cannot be had. Pass it to the supervisor as its observer."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        check_port(port)
        try:
            if importlib.util.find_spec("opentelemetry.exporter.prometheus") is None:
                raise ImportError("No module named 'opentelemetry.exporter.prometheus'")
            from prometheus_client import CollectorRegistry
        except ImportError as missing:
            raise missing_extra(missing) from missing
        self.group = GroupMetrics(tempfile.mkdtemp(prefix="idembus-metrics-"))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.group)
        try:
            self._served = serve_registry(registry, host, port)
        except ConfigurationError:
            shutil.rmtree(self.group.directory, ignore_errors=True)
            raise
        self._stopped = False
        log.info("serving metrics for Prometheus at %s/metrics (the sum of the workers)",
                 self._served.url)

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._served.address[1]

    def starting(self, index: int) -> dict[str, str]:
        """See :meth:`GroupMetrics.starting`."""
        return self.group.starting(index)

    def started(self, index: int, pid: int) -> None:
        """See :meth:`GroupMetrics.started`."""
        self.group.started(index, pid)

    def exited(self, index: int) -> None:
        """See :meth:`GroupMetrics.exited`."""
        self.group.exited(index)

    def stop(self) -> None:
        """Stop serving and remove the workers' files (once; later calls do nothing)."""
        if self._stopped:
            return
        self._stopped = True
        self._served.stop(STOP_TIMEOUT)
        shutil.rmtree(self.group.directory, ignore_errors=True)

    def __enter__(self) -> GroupMetricsServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
