"""Where the sample's queues live, chosen by URL: a kombu broker (``memory://``,
``amqp://``, ``redis://``), a PostgreSQL database (the PostgreSQL transport) or MongoDB (a
server, or mongomock in this process).

One :class:`Broker` per run: its transports share a namespace — a kombu events exchange of
their own, tables (PostgreSQL) or a database (MongoDB) of their own — so that runs sharing
a server do not see each other's messages, and :meth:`Broker.clean` removes them.
"""

from __future__ import annotations

from typing import Any

from idembus.transports.base import Transport
from idembus.transports.kombu import KombuTransport
from idembus.transports.urls import MONGODB_SCHEMES, POSTGRES_SCHEMES


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


class Broker:
    """Transports on ``url`` for the namespace ``namespace`` (lower-case letters, digits
    and ``_``). ``mongomock``: serve a ``mongodb://`` URL with one mongomock client in this
    process (no server needed). ``exchange``: the events exchange of a kombu broker (its
    default otherwise). ``options``: more keyword arguments of the transport class."""

    def __init__(self, url: str, namespace: str, *, mongomock: bool = False,
                 exchange: str | None = None, visibility_timeout: float | None = None,
                 **options: Any) -> None:
        self.url = url
        self.namespace = namespace
        self.exchange = exchange
        self.options = options
        if visibility_timeout is not None and scheme_of(url) in (POSTGRES_SCHEMES
                                                                 | MONGODB_SCHEMES):
            self.options["visibility_timeout"] = visibility_timeout
        self.kind = ("postgresql" if scheme_of(url) in POSTGRES_SCHEMES
                     else "mongodb" if scheme_of(url) in MONGODB_SCHEMES else "kombu")
        self._mongo_client: Any = None
        if self.kind == "mongodb":
            if mongomock:
                import mongomock as embedded

                self._mongo_client = embedded.MongoClient(url)
            else:
                import pymongo

                self._mongo_client = pymongo.MongoClient(url, tz_aware=True)

    @property
    def keeps_queues_in_a_database(self) -> bool:
        return self.kind != "kombu"

    @property
    def table_prefix(self) -> str:
        """The PostgreSQL transport's tables: ``<namespace>_bus_*``."""
        return f"{self.namespace}_bus"

    def transport(self) -> Transport:
        """A new transport on this broker, in this namespace."""
        if self.kind == "postgresql":
            from idembus.transports.postgres import PostgresTransport

            return PostgresTransport(self.url, table_prefix=self.table_prefix, **self.options)
        if self.kind == "mongodb":
            from idembus.transports.mongo import MongoTransport

            return MongoTransport(self._mongo_client, database=f"{self.namespace}_bus",
                                  **self.options)
        options = dict(self.options)
        if self.exchange is not None:
            options["exchange"] = self.exchange
        return KombuTransport(self.url, **options)

    def migrate(self) -> None:
        """Create the tables or indexes of a database's queues (nothing for a broker)."""
        transport = self.transport()
        try:
            transport.migrate()
        finally:
            transport.close()

    def clean(self, queues: list[str]) -> None:
        """Remove ``queues`` and the namespace's exchange, or the database's tables."""
        if self.url.startswith("memory"):
            return
        transport = self.transport()
        try:
            drop = getattr(transport, "drop_tables", None)
            if drop is not None:
                drop()
            else:
                assert isinstance(transport, KombuTransport)
                for queue in queues:
                    transport.delete_queue(queue)
                if self.exchange is not None:
                    transport.delete_exchange()
        finally:
            transport.close()
            if self._mongo_client is not None:
                self._mongo_client.close()
