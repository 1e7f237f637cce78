"""Which transport serves a URL: ``Endpoint(transport="...")`` and the command line."""

from __future__ import annotations

from ..errors import ConfigurationError
from ..redaction import redact
from .base import Transport

#: URL schemes of the PostgreSQL transport.
POSTGRES_SCHEMES = frozenset({"postgresql", "postgres"})
#: URL schemes of the MongoDB transport.
MONGODB_SCHEMES = frozenset({"mongodb", "mongodb+srv"})


def transport_for(url: str) -> Transport:
    """The transport of ``url`` with its defaults: ``postgresql://`` or ``postgres://``
    (:class:`~idembus.transports.postgres.PostgresTransport`, the ``[postgres]`` extra),
    ``mongodb://`` (:class:`~idembus.transports.mongo.MongoTransport`), any other kombu URL
    (:class:`~idembus.transports.kombu.KombuTransport`: ``memory://``, ``amqp://``,
    ``redis://``)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in POSTGRES_SCHEMES:
        try:
            from .postgres import PostgresTransport
        except ImportError as missing:
            raise ConfigurationError(
                f"transport URL {redact(url)!r} needs psycopg 3: pip install "
                f"'idembus[postgres]' ({missing})") from missing
        return PostgresTransport(url)
    if scheme in MONGODB_SCHEMES:
        from .mongo import MongoTransport

        return MongoTransport(url)
    from .kombu import KombuTransport

    return KombuTransport(url)
