"""One message's latency end to end, batching on and off, at a light and a heavy load.

Part ``latency`` of ``python -m bench.postgres``. The same endpoint as the throughput grid
(``idembus run bench.pg_handlers:factory``, one worker process) on RabbitMQ and PostgreSQL;
the driver sends ``IncrementCounter`` commands at a fixed rate (an open loop: each is due
at ``start + i / rate``, whatever the worker does) and a consumer of the sink queue
receives each ``CounterIncremented``; a message's latency is from just before its send to
the receipt of its event (matched by the event's ``idembus.causation_id``), so it includes
the broker both ways, the load, the handler, the commit and the confirmed publish. The
first ``warmup`` messages are not counted.

The loads are fractions of a rate the caller gives (``bench.postgres`` passes the best
one-worker batched rate of the same run's grid, or measures that worker at full speed first
when the run has no grid, or takes ``--latency-rate``): 10 % (light) and 80 % (heavy). The
question it answers: at light load, does batching add more than its linger (2 ms) to p50
and p99? Each result is ``{p50_ms, p99_ms, max_ms, sent, received}``.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kombu
from kombu import Queue

from bench.pg_common import RunNames
from bench.pg_idembus import command, configuration, create_tables, envelopes
from bench.pg_procs import Workers
from bench.pg_runner import ROOT, STOP_TIMEOUT
from bench.pg_topology import Broker, Cleanup
from idembus import headers as h

log = logging.getLogger(__name__)
#: The loads measured, as fractions of the reference rate.
LOADS = {"light": 0.1, "heavy": 0.8}
#: The batch size of the batched runs (as the grid's quick batched configurations).
BATCH = 32
#: The worker's threads in every latency run.
THREADS = 2


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


class _Sink:
    """Receives the run's events on a connection of its own; notes when each arrived."""

    def __init__(self, names: RunNames) -> None:
        self.arrived: dict[str, float] = {}
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._names = names
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._consume, name="bench-sink", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the sink consumer did not start")

    def _consume(self) -> None:
        with kombu.Connection(self._names.amqp_url) as connection:
            def on_message(message: kombu.Message) -> None:
                cause = message.headers.get(h.CAUSATION_ID)
                with self._changed:
                    self.arrived.setdefault(cause, time.perf_counter())
                    self._changed.notify_all()
                message.ack()

            with connection.Consumer([Queue(self._names.sink_queue, no_declare=True)],
                                     on_message=on_message, prefetch_count=256):
                self._ready.set()
                while not self._stop.is_set():
                    try:
                        connection.drain_events(timeout=0.2)
                    except TimeoutError:
                        continue

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: len(self.arrived) >= count, timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def measure(*, rate: float, batch: int, count: int, warmup: int, logs: Path,
            threads: int = THREADS) -> dict[str, Any]:
    """Send ``warmup + count`` messages at ``rate`` a second to one worker (``batch``: its
    batch size, 0: one at a time) and return the latency figures of the last ``count``."""
    names = RunNames.fresh()
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    total = warmup + count
    try:
        broker.declare_sink(names)
        cleanup.queues.append(names.error_queue)
        create_tables(names, cleanup)
        broker.declare_queue(names.input_queue)
        prepared = list(envelopes(names, range(total)))
        config = configuration(1, threads, batch)
        log_path = logs / f"latency-{config.key}-{names.suffix}.log"
        with Workers(command(config), environment=names.environment(), log=log_path,
                     cwd=ROOT, stop_timeout=STOP_TIMEOUT) as workers:
            _wait(lambda: _consumers(broker, names.input_queue) > 0, 60, workers.alive)
            sink = _Sink(names)
            try:
                sent = _send_paced(broker, names, prepared, rate)
                if not sink.wait_for(total, timeout=60 + total / rate):
                    raise RuntimeError(f"{len(sink.arrived)} of {total} events arrived; "
                                       f"worker log {log_path}")
            finally:
                sink.stop()
        latencies = [(sink.arrived[message_id] - at) * 1000
                     for message_id, at in list(sent.items())[warmup:]]
        return {"rate": round(rate, 1), "batch": batch, "threads": threads,
                "p50_ms": round(statistics.median(latencies), 2),
                "p99_ms": round(percentile(latencies, 0.99), 2),
                "max_ms": round(max(latencies), 2), "sent": total,
                "received": len(sink.arrived)}
    finally:
        broker.close()
        cleanup.run()


def _send_paced(broker: Broker, names: RunNames, prepared: list[Any],
                rate: float) -> dict[str, float]:
    """Publish each envelope at its due time; when each was sent, by message id."""
    sent: dict[str, float] = {}
    start = time.perf_counter()
    for index, envelope in enumerate(prepared):
        due = start + index / rate
        pause = due - time.perf_counter()
        if pause > 0:
            time.sleep(pause)  # pacing an open loop, not waiting for a result
        message_id = envelope.headers[h.MESSAGE_ID]
        sent[message_id] = time.perf_counter()
        broker.publish_raw(names.input_queue, envelope.body.encode(), dict(envelope.headers))
    return sent


def _consumers(broker: Broker, queue: str) -> int:
    _, _, consumers = broker.channel.queue_declare(queue=queue, passive=True)
    return int(consumers)


def _wait(condition: Callable[[], bool], timeout: float, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError("the worker did not start consuming")
        time.sleep(0.05)


def run_latency(reference_rate: float, *, count: int, warmup: int,
                logs: Path) -> dict[str, Any]:
    """Every load with batching on and off, interleaved; each result and the light load's
    verdict (batching's extra p50 and p99 against its linger)."""
    results: dict[str, Any] = {"reference_rate": round(reference_rate, 1)}
    for load, fraction in LOADS.items():
        for batch in (BATCH, 0):
            key = f"{load}_{'batched' if batch else 'single'}"
            results[key] = measure(rate=reference_rate * fraction, batch=batch,
                                   count=count, warmup=warmup, logs=logs)
            log.info("latency %s: %s", key, results[key])
    light_batched, light_single = results["light_batched"], results["light_single"]
    results["light_extra_p50_ms"] = round(light_batched["p50_ms"] - light_single["p50_ms"], 2)
    results["light_extra_p99_ms"] = round(light_batched["p99_ms"] - light_single["p99_ms"], 2)
    return results


def latency_line(results: dict[str, Any]) -> str:
    """The ``latency:`` line of the report."""
    parts = [f"{key}=p50 {value['p50_ms']}ms p99 {value['p99_ms']}ms @{value['rate']}/s"
             for key, value in results.items() if isinstance(value, dict)]
    return ("latency: " + "; ".join(parts) + f"; batching adds at light load "
            f"p50 {results['light_extra_p50_ms']:+}ms p99 {results['light_extra_p99_ms']:+}ms")
