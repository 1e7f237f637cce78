"""The Dramatiq variant: ``dramatiq bench.pg_dramatiq:setup --processes P --threads T``.

``setup`` (called by Dramatiq's command line in every worker process) makes a
``RabbitmqBroker`` for the run with Dramatiq's default middleware and declares the actor on
the run's input queue. The actor does the peers' work (:class:`bench.pg_work.PeerWork`: one
SQL transaction, one publish with confirms; each worker thread has its own connections);
Dramatiq acknowledges the message after the actor returns, and prefetches twice the
threads, its default. Retries are off (``max_retries=0``): none is expected, and a failure
should show rather than be repeated. The input is the same messages sent with the actor's
own ``send``; Dramatiq declares its delay and dead-letter queues (``.DQ``, ``.XQ``), which
the run deletes with the rest.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from urllib.parse import quote, urlparse

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker

from bench.pg_common import RunNames, aggregate_of, message_id_of
from bench.pg_runner import Config
from bench.pg_topology import Broker, Cleanup, create_peer_tables, peer_totals
from bench.pg_work import PeerWork

PROCESSES = (1, 2)
THREADS = (1, 2, 3, 4)
QUICK = ((1, 4), (2, 2), (2, 4))
ACTOR = "bench_count"


def make_broker(names: RunNames) -> tuple[RabbitmqBroker, dramatiq.Actor[..., None]]:
    broker = RabbitmqBroker(url=pika_url(names.amqp_url))
    work = PeerWork(names)

    def count(message_id: str, aggregate: str) -> None:
        work.handle(message_id, aggregate)

    actor = dramatiq.actor(count, actor_name=ACTOR, queue_name=names.input_queue,
                           broker=broker, max_retries=0)
    return broker, actor


def pika_url(url: str) -> str:
    """kombu's ``amqp://host//`` (virtual host ``/``) in pika's spelling, ``.../%2F``."""
    parsed = urlparse(url)
    virtual_host = parsed.path[1:] or "/"
    return parsed._replace(path="/" + quote(virtual_host, safe="")).geturl()


def setup() -> None:
    """The broker Dramatiq's command line uses (``dramatiq bench.pg_dramatiq:setup``)."""
    broker, _ = make_broker(RunNames.from_environment())
    dramatiq.set_broker(broker)


def preload(actor: dramatiq.Actor[..., None], names: RunNames, indexes: Iterable[int]) -> None:
    for index in indexes:
        actor.send(message_id_of(names, index), aggregate_of(index))


class DramatiqVariant:
    name = "dramatiq"
    title = "Dramatiq, RabbitmqBroker (dramatiq --processes P --threads T)"

    def configurations(self, quick: bool) -> list[Config]:
        pairs = QUICK if quick else [(p, t) for p in PROCESSES for t in THREADS]
        return [Config(f"{p}p{t}t", f"{p} process{'es' if p > 1 else ''} x {t} "
                       f"thread{'s' if t > 1 else ''}", {"processes": p, "threads": t})
                for p, t in pairs]

    def prepare(self, names: RunNames, broker: Broker, cleanup: Cleanup, total: int) -> None:
        cleanup.tables += [names.counters_table, names.processed_table]
        cleanup.queues += [f"{names.input_queue}.DQ", f"{names.input_queue}.XQ"]
        create_peer_tables(names)
        dramatiq_broker, actor = make_broker(names)
        try:
            preload(actor, names, range(total))
        finally:
            dramatiq_broker.close()

    def command(self, names: RunNames, config: Config) -> list[str]:
        return [sys.executable, "-m", "dramatiq", "bench.pg_dramatiq:setup",
                "--processes", str(config.settings["processes"]),
                "--threads", str(config.settings["threads"]),
                "--queues", names.input_queue, "--worker-shutdown-timeout", "10000"]

    def verify(self, names: RunNames, broker: Broker, total: int) -> list[str]:
        counted, processed = peer_totals(names)
        problems = []
        if counted != total or processed != total:
            problems.append(f"counters sum to {counted} with {processed} rows for {total}")
        failed = broker.depth(f"{names.input_queue}.XQ")
        if failed:
            problems.append(f"{failed} messages dead-lettered")
        return problems
