"""The raw kombu variant: ``python -m bench.pg_raw``, in 1 and 2 processes.

The least a hand-written consumer can do for the same result: one thread per process
consumes the input queue (prefetch 16, as idembus), and per message does the peers' work
(:class:`bench.pg_work.PeerWork`: one SQL transaction, one publish with confirms on a
separate connection) and acknowledges. No decoding beyond ``json.loads``, no
deduplication, no retries, no error queue: a baseline, not a design to copy.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Iterable

import kombu
from kombu import Queue

from bench.pg_common import PREFETCH, RunNames, aggregate_of, message_id_of
from bench.pg_runner import Config
from bench.pg_topology import Broker, Cleanup, create_peer_tables, peer_totals
from bench.pg_work import PeerWork

PROCESSES = (1, 2)
DRAIN_TIMEOUT = 0.1


def consume(names: RunNames, stop: threading.Event) -> None:
    """Consume the run's input queue until ``stop`` is set."""
    work = PeerWork(names)

    def on_message(message: kombu.Message) -> None:
        body = json.loads(message.body)
        work.handle(body["message_id"], body["aggregate"])
        message.ack()

    try:
        with kombu.Connection(names.amqp_url) as connection, connection.Consumer(
                [Queue(names.input_queue, durable=True, no_declare=True)],
                on_message=on_message, prefetch_count=PREFETCH):
            while not stop.is_set():
                try:
                    connection.drain_events(timeout=DRAIN_TIMEOUT)
                except TimeoutError:
                    continue
    finally:
        work.close()


def preload(broker: Broker, names: RunNames, indexes: Iterable[int]) -> None:
    for index in indexes:
        message_id = message_id_of(names, index)
        body = json.dumps({"message_id": message_id, "aggregate": aggregate_of(index)})
        broker.publish_raw(names.input_queue, body.encode(), {"message_id": message_id})


class RawVariant:
    name = "raw_kombu"
    title = "raw kombu consume -> SQL -> publish -> ack loop (python -m bench.pg_raw)"

    def configurations(self, quick: bool) -> list[Config]:
        return [Config(f"{count}p", f"{count} process{'es' if count > 1 else ''}",
                       {"processes": count}) for count in PROCESSES]

    def prepare(self, names: RunNames, broker: Broker, cleanup: Cleanup, total: int) -> None:
        cleanup.tables += [names.counters_table, names.processed_table]
        create_peer_tables(names)
        broker.declare_queue(names.input_queue)
        preload(broker, names, range(total))

    def command(self, names: RunNames, config: Config) -> list[str]:
        return [sys.executable, "-m", "bench.pg_raw", str(config.settings["processes"])]

    def verify(self, names: RunNames, broker: Broker, total: int) -> list[str]:
        counted, processed = peer_totals(names)
        if counted != total or processed != total:
            return [f"counters sum to {counted} with {processed} rows for {total} messages"]
        return []


def main(argv: list[str]) -> int:
    """``python -m bench.pg_raw [PROCESSES]``: the parent forks the other processes and
    passes SIGTERM on; each process consumes until SIGTERM."""
    import multiprocessing

    names = RunNames.from_environment()
    processes = int(argv[0]) if argv else 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    others = [multiprocessing.get_context("fork").Process(target=consume, args=(names, stop))
              for _ in range(processes - 1)]
    for process in others:
        process.start()
    try:
        consume(names, stop)
    finally:
        for process in others:
            if process.pid is not None:
                process.terminate()
            process.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
