"""A worker's metrics, written to a file for its supervisor (``idembus run --workers N
--metrics-port P``).

Each worker of a supervised group writes what a single ``idembus run --metrics-port``
would serve — the Prometheus text of prometheus_client's default registry: the endpoint's
OpenTelemetry instruments through the OpenTelemetry Prometheus exporter, and the process's
``process_*`` and ``python_*`` series — to the file its supervisor names in
``IDEMBUS_METRICS_FILE``, every :data:`INTERVAL` seconds and once more when it stops. Each
write replaces the file whole (a new file renamed over the old one), so a reader never sees
half of one, and a worker killed with SIGKILL leaves its last complete snapshot behind.
The supervisor's side: :mod:`idembus.observability.metrics_group`.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from typing import Any

from .prometheus import measure_endpoint, missing_extra, prometheus_meter_provider

log = logging.getLogger(__name__)

#: Environment variable naming the file a supervised worker writes its metrics to.
METRICS_FILE = "IDEMBUS_METRICS_FILE"
#: Seconds between two snapshots: how old, at most, what the supervisor serves is.
INTERVAL = 1.0


class SnapshotWriter:
    """Writes ``meter_provider``'s process — prometheus_client's default registry — to
    ``path`` every ``interval`` seconds from a daemon thread, until :meth:`stop` (which
    writes a last snapshot and shuts the provider down)."""

    def __init__(self, path: str | os.PathLike[str], meter_provider: Any, *,
                 interval: float = INTERVAL) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        try:
            import prometheus_client
        except ImportError as missing:
            raise missing_extra(missing) from missing
        self.path = pathlib.Path(path)
        #: The provider whose instruments the snapshots show.
        self.meter_provider = meter_provider
        self._client = prometheus_client
        self._interval = interval
        self._stopping = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="idembus-metrics-snapshots",
                                        daemon=True)
        self._stopped = False

    def start(self) -> SnapshotWriter:
        """Write a first snapshot now, then one every interval."""
        self.write()
        self._thread.start()
        return self

    def write(self) -> None:
        """Write a snapshot now (a failure is logged once, until a write succeeds again)."""
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_bytes(self._client.generate_latest(self._client.REGISTRY))
            os.replace(temporary, self.path)
        except OSError as error:
            if not self._failing:
                log.warning("cannot write this worker's metrics to %s: %s", self.path, error)
            self._failing = True
        else:
            self._failing = False

    def stop(self) -> None:
        """Write a last snapshot, stop the thread and shut the provider down (once)."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self.write()
        self.meter_provider.shutdown()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            self.write()


def write_endpoint_metrics(endpoint: Any, path: str | os.PathLike[str], *,
                           interval: float = INTERVAL) -> SnapshotWriter:
    """Measure ``endpoint`` (as :func:`~idembus.observability.prometheus.serve_endpoint_metrics`
    does) and write its process's metrics to ``path`` until the writer is stopped."""
    provider = prometheus_meter_provider(endpoint.name)
    writer = SnapshotWriter(path, provider, interval=interval)
    measure_endpoint(endpoint, provider, "--metrics-port")
    return writer.start()
