"""The ordering sample as worker processes on a shared broker and PostgreSQL.

Endpoint factories for ``idembus run``: the same Sales, Billing and Shipping endpoints as
:mod:`samples.ordering.system`, with the same handlers, but on a broker and a database that
several processes share, and with a payment gateway whose charges live in PostgreSQL::

    export ORDERING_TRANSPORT=amqp://guest:guest@127.0.0.1:5672//
    export ORDERING_POSTGRES=postgresql://postgres@127.0.0.1:5432/test
    export ORDERING_NAMESPACE=shop1
    idembus run samples.ordering.deployment:sales --workers 3 &
    idembus run samples.ordering.deployment:billing --workers 3 &
    idembus run samples.ordering.deployment:shipping --workers 3 &

Environment
===========
``ORDERING_TRANSPORT``  where the queues are: a kombu URL of the broker (default
                        ``amqp://guest:guest@127.0.0.1:5672//``), or a postgresql:// URL (the
                        PostgreSQL transport; in ``ORDERING_POSTGRES``'s database, commit,
                        send and acknowledgement are one transaction)
``ORDERING_POSTGRES``   libpq URL of the database (default
                        ``postgresql://postgres@127.0.0.1:5432/test``)
``ORDERING_NAMESPACE``  keeps deployments that share a broker and a database apart
                        (default ``ordering``): lower-case letters, digits and ``_``,
                        starting with a letter, at most 24 characters
``ORDERING_DEFER_FRESH_REDISPATCH``  seconds during which a duplicate leaves a fresh,
                        undispatched entry to its committer and the outbox (default 0:
                        ``Endpoint(defer_fresh_redispatch=...)``)
``ORDERING_STATUS_INTERVAL``  seconds between status reports (default 5)
``ORDERING_VISIBILITY_TIMEOUT``  seconds before a dead worker's messages are due again
                        on the PostgreSQL transport (default 15)
``ORDERING_SHARED_TRANSACTIONS``  ``0``: on the PostgreSQL transport, commit and send apart
                        as with a broker (default ``1``: one transaction)
``ORDERING_CONCURRENCY``  consumer threads of each endpoint process (default 1;
                        ``idembus run --concurrency`` overrides)

Names derived from the namespace ``ns``
=======================================
* queues ``sales-ns``, ``billing-ns``, ``shipping-ns`` and the error queue ``error-ns``;
* the events exchange ``idembus.events-ns`` (so that another deployment's Billing does not
  receive this one's ``OrderPlaced``), or on the PostgreSQL transport its tables
  ``ns_bus_*``;
* the tables ``ns_sales_*``, ``ns_billing_*``, ``ns_shipping_*`` (:class:`PostgresStorage`
  with the table prefix ``ns_<endpoint>``) and the gateway's ``ns_charges``.

Each endpoint creates its tables when it starts and the gateway its table on first use;
:meth:`Deployment.migrate` creates them all at once, :meth:`Deployment.drop` removes the
tables, queues and exchange.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from idembus import Endpoint, OutboxPolicy
from idembus.handlers import Handler
from idembus.storage.postgres import PostgresStorage
from idembus.transports.base import Transport
from samples.ordering.billing import BillingHandler
from samples.ordering.brokers import Broker
from samples.ordering.gateway import PostgresPaymentGateway
from samples.ordering.sales import OrderHandler
from samples.ordering.shipping import ShippingHandler

DEFAULT_TRANSPORT = "amqp://guest:guest@127.0.0.1:5672//"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_NAMESPACE = "ordering"
#: The endpoints of the sample, in the order messages flow through them.
ENDPOINTS = ("sales", "billing", "shipping")

_NAMESPACE = re.compile(r"^[a-z][a-z0-9_]{0,23}$")


@dataclass(frozen=True)
class Deployment:
    """Where one deployment of the sample lives; every name is derived from ``namespace``."""

    transport_url: str = DEFAULT_TRANSPORT
    postgres_url: str = DEFAULT_POSTGRES
    namespace: str = DEFAULT_NAMESPACE
    #: Consumer threads of each endpoint process (``idembus run --concurrency`` overrides).
    concurrency: int = 1
    #: ``Endpoint(defer_fresh_redispatch=...)`` of every endpoint.
    defer_fresh_redispatch: float = 0.0
    #: ``Endpoint(status_interval=...)`` of every endpoint.
    status_interval: float = 5.0
    #: Seconds before a dead worker's messages are due again on a database's queues.
    visibility_timeout: float = 15.0
    #: On the PostgreSQL transport in the storage's database: commit, send and
    #: acknowledge in one transaction (``PostgresTransport(shared_transactions=...)``).
    shared_transactions: bool = True

    def __post_init__(self) -> None:
        if not _NAMESPACE.match(self.namespace):
            raise ValueError(
                f"namespace {self.namespace!r} must be lower-case letters, digits and '_', "
                "starting with a letter, at most 24 characters"
            )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Deployment:
        """The deployment named by ``ORDERING_*`` variables (see the module docstring)."""
        return cls(
            transport_url=environ.get("ORDERING_TRANSPORT") or DEFAULT_TRANSPORT,
            postgres_url=environ.get("ORDERING_POSTGRES") or DEFAULT_POSTGRES,
            namespace=environ.get("ORDERING_NAMESPACE") or DEFAULT_NAMESPACE,
            defer_fresh_redispatch=float(environ.get("ORDERING_DEFER_FRESH_REDISPATCH") or 0),
            status_interval=float(environ.get("ORDERING_STATUS_INTERVAL") or 5),
            visibility_timeout=float(environ.get("ORDERING_VISIBILITY_TIMEOUT") or 15),
            shared_transactions=environ.get("ORDERING_SHARED_TRANSACTIONS", "1") != "0",
            concurrency=int(environ.get("ORDERING_CONCURRENCY") or 1),
        )

    def environment(self) -> dict[str, str]:
        """The ``ORDERING_*`` variables that make the factories build this deployment."""
        return {"ORDERING_TRANSPORT": self.transport_url,
                "ORDERING_POSTGRES": self.postgres_url,
                "ORDERING_NAMESPACE": self.namespace,
                "ORDERING_DEFER_FRESH_REDISPATCH": str(self.defer_fresh_redispatch),
                "ORDERING_STATUS_INTERVAL": str(self.status_interval),
                "ORDERING_VISIBILITY_TIMEOUT": str(self.visibility_timeout),
                "ORDERING_SHARED_TRANSACTIONS": "1" if self.shared_transactions else "0",
                "ORDERING_CONCURRENCY": str(self.concurrency)}

    # -- names ---------------------------------------------------------------------------

    def queue(self, endpoint: str) -> str:
        """The queue (and endpoint name) of ``endpoint``: ``sales``, ``billing``..."""
        return f"{endpoint}-{self.namespace}"

    @property
    def error_queue(self) -> str:
        return f"error-{self.namespace}"

    @property
    def queues(self) -> list[str]:
        """Every queue of the deployment, the error queue last."""
        return [self.queue(name) for name in ENDPOINTS] + [self.error_queue]

    @property
    def exchange(self) -> str:
        return f"idembus.events-{self.namespace}"

    # -- parts ---------------------------------------------------------------------------

    def broker(self) -> Broker:
        """Where the queues are: RabbitMQ (or another kombu broker), or tables of the
        PostgreSQL transport (``<namespace>_bus_*``), whose leases run out after
        ``visibility_timeout`` seconds."""
        options = {} if self.shared_transactions else {"shared_transactions": False}
        return Broker(self.transport_url, self.namespace, exchange=self.exchange,
                      visibility_timeout=self.visibility_timeout, **options)

    def transport(self) -> Transport:
        return self.broker().transport()

    def storage(self, endpoint: str) -> PostgresStorage:
        return PostgresStorage(self.postgres_url, table_prefix=f"{self.namespace}_{endpoint}")

    def gateway(self) -> PostgresPaymentGateway:
        return PostgresPaymentGateway(self.postgres_url, table=f"{self.namespace}_charges")

    def endpoint(self, name: str, handler: Handler | type[Handler]) -> Endpoint:
        """The endpoint ``name`` with one handler, on this deployment's broker and tables."""
        return Endpoint(
            self.queue(name),
            transport=self.transport(),
            storage=self.storage(name),
            handlers=[handler],
            error_queue=self.error_queue,
            concurrency=self.concurrency,
            outbox=OutboxPolicy(defer_fresh_redispatch=self.defer_fresh_redispatch),
            status_interval=self.status_interval,
        )

    # -- schema --------------------------------------------------------------------------

    def migrate(self) -> None:
        """Create every table of the deployment (idempotent)."""
        self.broker().migrate()
        for name in ENDPOINTS:
            storage = self.storage(name)
            try:
                storage.migrate()
            finally:
                storage.close()
        gateway = self.gateway()
        try:
            gateway.migrate()
        finally:
            gateway.close()

    def drop(self) -> None:
        """Delete the queues and the exchange, and drop every table of the deployment."""
        self.broker().clean(self.queues)
        for name in ENDPOINTS:
            storage = self.storage(name)
            try:
                storage.drop_tables()
            finally:
                storage.close()
        gateway = self.gateway()
        try:
            gateway.drop_table()
        finally:
            gateway.close()


def sales() -> Endpoint:
    """``idembus run samples.ordering.deployment:sales``: the Order aggregate."""
    return Deployment.from_environment().endpoint("sales", OrderHandler)


def billing() -> Endpoint:
    """``idembus run samples.ordering.deployment:billing``: charges through the gateway."""
    deployment = Deployment.from_environment()
    gateway = deployment.gateway()  # same charge() as FakePaymentGateway, kept in PostgreSQL
    return deployment.endpoint("billing", BillingHandler(gateway))


def shipping() -> Endpoint:
    """``idembus run samples.ordering.deployment:shipping``: the Shipment aggregate."""
    return Deployment.from_environment().endpoint("shipping", ShippingHandler)
