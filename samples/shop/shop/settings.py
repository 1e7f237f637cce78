"""Where the shop's services find their broker and database: environment variables.

``SHOP_BROKER_URL``    the broker (default ``amqp://guest:guest@127.0.0.1:5672//``)
``SHOP_DATABASE_URL``  the PostgreSQL database (default ``postgresql://postgres@127.0.0.1:5432/shop``)

Every service keeps its own tables in that database (``orders_*``, ``payments_*``...): one
database is enough for a tutorial, and each service could move to its own later.
"""

from __future__ import annotations

import os

from idembus.storage.postgres import PostgresStorage

DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672//"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/shop"
#: Where every service puts the messages that failed for good (``idembus errors list``).
ERROR_QUEUE = "shop-errors"


def broker_url() -> str:
    """The broker's URL, from ``SHOP_BROKER_URL``."""
    return os.environ.get("SHOP_BROKER_URL", DEFAULT_BROKER_URL)


def database_url() -> str:
    """The database's URL, from ``SHOP_DATABASE_URL``."""
    return os.environ.get("SHOP_DATABASE_URL", DEFAULT_DATABASE_URL)


def storage(service: str) -> PostgresStorage:
    """The PostgreSQL storage of one service: its tables are prefixed with its name."""
    return PostgresStorage(database_url(), table_prefix=service)
