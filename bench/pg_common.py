"""Names and settings shared by the driver of ``bench.postgres`` and its worker processes.

One run of one configuration gets fresh names (a random suffix): its input queue, the topic
exchange events go to, the sink queue bound to it, and its tables. The driver hands them to
the workers it starts in one environment variable (:data:`ENVIRONMENT`), so that a worker
of any framework, started by that framework's own command line, finds them without flags.

The input is the same for every variant: message ``i`` has a unique id and names aggregate
``i % 1000`` (:func:`aggregate_of`), so that consecutive messages touch different rows and
optimistic conflicts are rare.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass

from bench.common import AMQP_URL, unique_suffix

POSTGRES_URL = os.environ.get("IDEMBUS_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
#: Environment variable carrying a :class:`RunNames` as JSON to the worker processes.
ENVIRONMENT = "IDEMBUS_BENCH_PG"
#: Aggregates (rows) the messages are spread over.
AGGREGATES = 1000
#: Messages the broker may push to each consumer ahead of processing: idembus' default,
#: used by the raw loop too (Celery and Dramatiq derive theirs from their own settings).
PREFETCH = 16
#: Routing key of the one message every variant publishes per input message.
EVENT_NAME = "bench.CounterIncremented"
#: Wire name of idembus' input command.
COMMAND_NAME = "bench.IncrementCounter"
#: Aggregate type (storage name) of idembus' counters.
AGGREGATE_TYPE = "Counter"
_IDS = uuid.UUID("3d0f2a4e-9b7c-4c1e-8f7a-1b2c3d4e5f60")


@dataclass(frozen=True)
class RunNames:
    """Where one run's messages and rows live; every name is unique to the run."""

    suffix: str
    amqp_url: str = AMQP_URL
    postgres_url: str = POSTGRES_URL

    @classmethod
    def fresh(cls) -> RunNames:
        return cls(unique_suffix())

    @property
    def input_queue(self) -> str:
        return f"bench-pg-in-{self.suffix}"

    @property
    def error_queue(self) -> str:
        return f"bench-pg-error-{self.suffix}"

    @property
    def exchange(self) -> str:
        return f"bench-pg.events.{self.suffix}"

    @property
    def sink_queue(self) -> str:
        return f"bench-pg-sink-{self.suffix}"

    @property
    def table_prefix(self) -> str:
        """Prefix of idembus' two tables (``<prefix>_aggregates``, ``<prefix>_processed``)."""
        return f"bench_{self.suffix}"

    @property
    def counters_table(self) -> str:
        """The peers' aggregate rows: ``(id text primary key, n bigint)``."""
        return f"bench_{self.suffix}_counters"

    @property
    def processed_table(self) -> str:
        """The peers' record of handled messages: ``(message_id text primary key)``."""
        return f"bench_{self.suffix}_done"

    def environment(self) -> dict[str, str]:
        """The environment of a worker process of this run."""
        return {**os.environ, ENVIRONMENT: json.dumps(asdict(self))}

    @classmethod
    def from_environment(cls) -> RunNames:
        try:
            return cls(**json.loads(os.environ[ENVIRONMENT]))
        except KeyError:
            raise SystemExit(
                f"{ENVIRONMENT} is not set: bench.postgres starts this worker") from None


def aggregate_of(index: int) -> str:
    """The aggregate message ``index`` changes."""
    return f"agg-{index % AGGREGATES:04d}"


def message_id_of(names: RunNames, index: int) -> str:
    """The id of message ``index`` of a run: unique, and the same when sent again."""
    return str(uuid.uuid5(_IDS, f"{names.suffix}/{index}"))
