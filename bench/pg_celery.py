"""The Celery variant: ``python -m bench.pg_celery C P`` runs Celery's own ``celery worker``
command (``app.worker_main``) with the prefork pool, concurrency C and prefetch multiplier P.

The task does the peers' work (:class:`bench.pg_work.PeerWork`: one SQL transaction, one
publish with confirms) with ``acks_late=True``, so the message is acknowledged after the
work, as in every variant. Results are ignored (no result backend: storing one would be
work the others do not do); gossip, mingle, heartbeats and remote control are off, as a
deployment tuned for throughput would have them. The input is the same messages sent with
Celery's own ``send_task``; Celery declares a direct exchange named after the queue, which
the run deletes with the rest.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from celery import Celery

from bench.pg_common import RunNames, aggregate_of, message_id_of
from bench.pg_runner import Config
from bench.pg_topology import Broker, Cleanup, create_peer_tables, peer_totals
from bench.pg_work import PeerWork

CONCURRENCY = (1, 2)
PREFETCH_MULTIPLIERS = (1, 2, 3, 4)
QUICK = ((1, 4), (2, 1), (2, 4))
TASK = "bench.count"


def make_app(names: RunNames, *, prefetch_multiplier: int = 1) -> Celery:
    app = Celery("bench_pg", broker=names.amqp_url, set_as_current=False)
    app.conf.update(
        task_default_queue=names.input_queue,
        task_acks_late=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=prefetch_multiplier,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    work = PeerWork(names)

    def count(message_id: str, aggregate: str) -> None:
        work.handle(message_id, aggregate)

    app.task(name=TASK, acks_late=True, ignore_result=True)(count)
    return app


def preload(app: Celery, names: RunNames, indexes: Iterable[int]) -> None:
    with app.producer_or_acquire() as producer:
        for index in indexes:
            app.send_task(TASK, args=(message_id_of(names, index), aggregate_of(index)),
                          queue=names.input_queue, producer=producer)


class CeleryVariant:
    name = "celery"
    title = "Celery, prefork pool, acks_late (celery worker -c C, prefetch multiplier P)"

    def configurations(self, quick: bool) -> list[Config]:
        pairs = QUICK if quick else [(c, p) for c in CONCURRENCY for p in PREFETCH_MULTIPLIERS]
        return [Config(f"c{c}p{p}", f"concurrency {c}, prefetch x{p}",
                       {"concurrency": c, "prefetch_multiplier": p}) for c, p in pairs]

    def prepare(self, names: RunNames, broker: Broker, cleanup: Cleanup, total: int) -> None:
        cleanup.tables += [names.counters_table, names.processed_table]
        cleanup.exchanges.append(names.input_queue)
        create_peer_tables(names)
        app = make_app(names)
        try:
            preload(app, names, range(total))
        finally:
            app.close()

    def command(self, names: RunNames, config: Config) -> list[str]:
        return [sys.executable, "-m", "bench.pg_celery", str(config.settings["concurrency"]),
                str(config.settings["prefetch_multiplier"])]

    def verify(self, names: RunNames, broker: Broker, total: int) -> list[str]:
        counted, processed = peer_totals(names)
        if counted != total or processed != total:
            return [f"counters sum to {counted} with {processed} rows for {total} messages"]
        return []


def main(argv: list[str]) -> None:
    concurrency, prefetch_multiplier = (int(value) for value in argv)
    names = RunNames.from_environment()
    app = make_app(names, prefetch_multiplier=prefetch_multiplier)
    app.worker_main(["worker", "--pool", "prefork", "--concurrency", str(concurrency),
                     "--queues", names.input_queue, "--without-gossip", "--without-mingle",
                     "--without-heartbeat", "--loglevel", "WARNING"])


if __name__ == "__main__":
    main(sys.argv[1:])
