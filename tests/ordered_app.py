"""An endpoint whose commands are ordered by key, for the ordered-processing tests and
bench (``tests/test_ordered_processing.py``, ``bench/ordered.py``): each ``Step`` appends
its ``seq`` to the list of its key, so a test reads whether every key saw 0, 1, 2, ... in
order, each once. ``Loose`` is the same command, unordered, for the bench's comparison."""

from __future__ import annotations

import os

from pydantic import BaseModel

from idembus import Command, Endpoint
from idembus.handlers import AggregateHandler, handles


class Step(Command, message_name="test.ordered.Step", ordered_by="key", partitions=16):
    key: str
    seq: int


class Loose(Command, message_name="test.ordered.Loose"):
    key: str
    seq: int


class Seen(BaseModel):
    seqs: list[int] = []


class Sequences(AggregateHandler[Seen]):
    """Appends each message's ``seq`` to its key's list."""

    def aggregate_id(self, message: Step | Loose) -> str:
        return message.key

    @handles
    def step(self, message: Step) -> None:
        self.state.seqs.append(message.seq)

    @handles
    def loose(self, message: Loose) -> None:
        self.state.seqs.append(message.seq)


def make() -> Endpoint:
    """The endpoint as ``idembus run tests.ordered_app:make`` starts it, from
    ``APP_QUEUE``, ``APP_TRANSPORT``, ``APP_POSTGRES``, ``APP_PREFIX`` and
    ``APP_ERROR_QUEUE`` (a PostgreSQL transport's tables are ``APP_PREFIX`` and ``q``);
    ``APP_LEASE``, if set, is the kombu transport's ``partition_lease`` (Redis)."""
    from idembus.storage.postgres import PostgresStorage
    from idembus.transports.kombu import KombuTransport
    from idembus.transports.postgres import PostgresTransport

    url = os.environ["APP_TRANSPORT"]
    lease = os.environ.get("APP_LEASE")
    return Endpoint(
        os.environ["APP_QUEUE"],
        transport=(PostgresTransport(url, table_prefix=os.environ["APP_PREFIX"] + "q")
                   if url.startswith("postgresql://")
                   else KombuTransport(url, partition_lease=float(lease)) if lease else url),
        storage=PostgresStorage(os.environ["APP_POSTGRES"],
                                table_prefix=os.environ["APP_PREFIX"]),
        handlers=[Sequences],
        error_queue=os.environ["APP_ERROR_QUEUE"],
        prefetch=8,
    )
