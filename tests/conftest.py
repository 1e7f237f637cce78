"""Shared fixtures: brokers, unique names, endpoints that clean up after themselves.

Real services are used where a test names them. Locally an unreachable service skips its
tests with the reason; under ``CI=true`` it fails them. A test that reaches a service is
marked with it (``amqp``, ``redis``, ``postgres``, ``mongodb``): ``make check`` deselects
those marks and runs without services, so :func:`require_service` fails a test that asks
for a service its marks do not name.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import kombu.transport.memory
import pytest

from idembus import Endpoint
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import MongoStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing.contract.base import eager_switching
from idembus.transports.base import Transport
from idembus.transports.kombu import KombuTransport

AMQP_URL = os.environ.get("IDEMBUS_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
REDIS_URL = os.environ.get("IDEMBUS_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("IDEMBUS_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
MONGODB_URL = os.environ.get("IDEMBUS_MONGODB_URL")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

_DEFAULT_PORTS = {"amqp": 5672, "redis": 6379, "mongodb": 27017, "postgresql": 5432}
#: The mark a test that reaches a service carries, by the scheme of the service's URL.
_SERVICE_MARKS = {"amqp": "amqp", "amqps": "amqp", "redis": "redis", "rediss": "redis",
                  "postgresql": "postgres", "postgres": "postgres", "mongodb": "mongodb"}
#: The test being run (one at a time): require_service reads its marks.
_running: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Remember the test being run (its setup, call and teardown), for require_marked."""
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.remove(item)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``spark`` the tests that use the Spark session (a JVM: seconds to start, then a
    core busy), so that ``make check`` leaves them to ``make test``; and give them 300 s
    (the first to run starts the session: half a minute on a busy machine)."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(300))


def require_marked(url: str, what: str) -> None:
    """Fail the running test unless it is marked with the service behind ``url``: an
    unmarked test would be run by ``make check``, which has no services."""
    mark = _SERVICE_MARKS.get(urlparse(url).scheme)
    if not _running or mark is None:
        return
    test = _running[-1]
    if test.get_closest_marker(mark) is None:
        pytest.fail(f"{test.nodeid} uses {what} but is not marked {mark!r}: add "
                    f"@pytest.mark.{mark} (make check runs without services and deselects "
                    f"the tests that need them by these marks)", pytrace=False)


def require_service(url: str, what: str) -> None:
    """Skip (locally) or fail (under CI=true) unless something listens at ``url``; fail at
    once if the running test is not marked with that service."""
    require_marked(url, what)
    parsed = urlparse(url)
    host = parsed.hostname or "127.0.0.1"
    port = parsed.port or _DEFAULT_PORTS.get(parsed.scheme, 0)
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        reason = f"{what} is not reachable at {host}:{port} ({exc})"
        if IN_CI:
            pytest.fail(f"{reason}; under CI=true every service must be up")
        pytest.skip(reason)


TRANSPORT_URLS = [
    pytest.param("memory://", id="memory"),
    pytest.param(AMQP_URL, id="amqp", marks=pytest.mark.amqp),
    pytest.param(REDIS_URL, id="redis", marks=pytest.mark.redis),
]


#: The transports that keep their queues in a database, for the suites that run on every
#: transport (the contract, the failure matrix): PostgreSQL, mongomock in this process, and
#: a real MongoDB when IDEMBUS_MONGODB_URL is set.
DATABASE_TRANSPORT_URLS = [
    pytest.param(POSTGRES_URL, id="postgresql-transport", marks=pytest.mark.postgres),
    pytest.param("mongomock://", id="mongomock-transport"),
    pytest.param(MONGODB_URL or "mongodb://", id="mongodb-transport", marks=pytest.mark.mongodb),
]
ALL_TRANSPORT_URLS = TRANSPORT_URLS + DATABASE_TRANSPORT_URLS


def required_transport(url: str) -> str:
    """``url``, once the service behind it is known to be reachable (else skip or fail)."""
    if url.startswith("amqp"):
        require_service(url, "RabbitMQ")
    elif url.startswith("redis"):
        require_service(url, "Redis")
    elif url.startswith(("postgresql", "postgres")):
        require_service(url, "PostgreSQL")
    elif url.startswith("mongodb"):
        if not MONGODB_URL:
            pytest.skip("set IDEMBUS_MONGODB_URL to run the MongoDB transport on a real server")
        require_service(MONGODB_URL, "MongoDB")
    return url


def is_kombu_url(url: str) -> bool:
    """Whether ``url`` is served by KombuTransport (not by a database transport)."""
    return url.split("://", 1)[0] in ("memory", "amqp", "amqps", "redis", "rediss")


def foreign_connection(url: str) -> kombu.Connection:
    """A plain kombu connection to ``url``, as a producer that knows nothing of idembus
    would open, but publishing with confirms on RabbitMQ: without them RabbitMQ 3.10 may
    drop the last messages a channel sent to a quorum queue when the connection closes
    straight after (seen under load: 15 of 26), which is the foreign producer's loss, not
    the consumer's."""
    if url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp"):
        return kombu.Connection(url, transport_options={"confirm_publish": True})
    return kombu.Connection(url)


@pytest.fixture(params=TRANSPORT_URLS)
def transport_url(request: pytest.FixtureRequest) -> str:
    return required_transport(request.param)


@pytest.fixture
def unique() -> str:
    """A suffix that keeps this test's queues and exchanges apart from every other's."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(autouse=True)
def _fresh_memory_broker() -> Iterator[None]:
    """kombu's memory:// keeps its broker at class level and never resets it."""
    yield
    kombu.transport.memory.Channel.queues.clear()
    kombu.transport.memory.Channel.events.clear()
    kombu.transport.memory.Transport.global_state.clear()


@pytest.fixture
def make_transport(transport_url: str, unique: str) -> Iterator[Callable[..., Any]]:
    """Transports on the parametrised broker, with this test's own exchange (or, on a
    database, tables or collections of its own, which every transport of the test shares
    and which are dropped afterwards)."""
    created: list[Any] = []
    shared: dict[str, Any] = {}

    def make(**options: Any) -> Any:
        transport: Transport
        if is_kombu_url(transport_url):
            options.setdefault("exchange", f"test-events-{unique}")
            transport = KombuTransport(transport_url, **options)
        elif transport_url.startswith(("postgresql", "postgres")):
            from idembus.transports.postgres import PostgresTransport

            options.setdefault("table_prefix", f"t{unique}")
            transport = PostgresTransport(transport_url, **options)
        else:
            from idembus.transports.mongo import MongoTransport

            if transport_url.startswith("mongomock"):
                import mongomock

                client = shared.setdefault("client", mongomock.MongoClient())
            else:
                client = transport_url
            transport = MongoTransport(client, database=f"idembus-test-{unique}", **options)
        created.append(transport)
        return transport

    yield make
    for transport in created:
        if is_kombu_url(transport_url) and not transport_url.startswith("memory"):
            transport.delete_exchange()
    if created and transport_url.startswith(("postgresql", "postgres")):
        created[0].drop_tables()
    for transport in created:
        transport.close()
    if created and transport_url.startswith("mongodb"):
        import pymongo

        with pymongo.MongoClient(transport_url) as client:
            client.drop_database(f"idembus-test-{unique}")


@pytest.fixture
def queue_name(unique: str, transport_url: str) -> Iterator[Callable[[str], str]]:
    """``queue_name("sales")`` -> a queue name unique to this test, deleted afterwards
    (on a database with the transport's tables)."""
    names: list[str] = []

    def name(prefix: str) -> str:
        names.append(f"{prefix}-{unique}")
        return names[-1]

    yield name
    if is_kombu_url(transport_url) and not transport_url.startswith("memory"):
        cleaner = KombuTransport(transport_url)
        for queue in names:
            cleaner.delete_queue(queue)
        cleaner.close()


@pytest.fixture
def make_endpoint(
    make_transport: Callable[..., KombuTransport], queue_name: Callable[[str], str]
) -> Iterator[Callable[..., Endpoint]]:
    """Endpoints on the parametrised broker with unique queue names; closed afterwards.

    ``make_endpoint("sales", handlers=[...], routes=...)``: the endpoint is named
    ``sales-<unique>``; its error queue is ``error-<unique>``; storage defaults to the
    endpoint's own (an in-process MemoryStorage).
    """
    endpoints: list[Endpoint] = []

    def make(name: str, **options: Any) -> Endpoint:
        options.setdefault("transport", make_transport())
        options.setdefault("error_queue", queue_name("error"))
        endpoint = Endpoint(queue_name(name), **options)
        endpoints.append(endpoint)
        return endpoint

    yield make
    for endpoint in endpoints:
        endpoint.close()


STORAGE_KINDS = [
    pytest.param("memory", id="memory-storage"),
    pytest.param("mongomock", id="mongomock"),
    pytest.param("mongodb", id="mongodb", marks=pytest.mark.mongodb),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=STORAGE_KINDS)
def storage_factory(request: pytest.FixtureRequest, unique: str) -> Iterator[Callable[..., Any]]:
    """Factories of fresh storages of each backend: ``storage_factory(processed_window=3)``."""
    kind: str = request.param
    if kind == "mongodb":
        if not MONGODB_URL:
            pytest.skip("set IDEMBUS_MONGODB_URL to run the storage contract on a real MongoDB")
        require_service(MONGODB_URL, "MongoDB")
    if kind == "postgres":
        require_service(POSTGRES_URL, "PostgreSQL")
    created: list[Any] = []

    def make(**options: Any) -> Any:
        if kind == "memory":
            storage: Any = MemoryStorage(**options)
        elif kind == "mongomock":
            storage = MongoStorage.embedded(f"test-{unique}", **options)
        elif kind == "postgres":
            if "processed_window" in options:
                pytest.skip("PostgreSQL keeps a row per processed message: no count window")
            storage = PostgresStorage(POSTGRES_URL, table_prefix=f"t{unique}_{len(created)}",
                                      **options)
            storage.verify()
        else:
            storage = MongoStorage(MONGODB_URL, database=f"idembus-test-{unique}", **options)
        created.append(storage)
        return storage

    yield make
    for storage in created:
        if kind == "mongodb":
            storage.client.drop_database(storage.database.name)
        if kind == "postgres":
            storage.drop_tables()
        storage.close()


@pytest.fixture
def eager_thread_switching() -> Iterator[None]:
    """Make the interpreter switch threads every few bytecodes instead of every 5 ms.

    Without this, a commit is short enough to run within one time slice and an unguarded
    mongomock passes race tests by luck; with it, an unguarded mongomock lets several of
    the racing commits through in most rounds.
    """
    with eager_switching():
        yield


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One SparkSession for the whole run (starting one takes seconds). ``local[2,3]``: two
    cores, and tasks retried up to 3 times (plain ``local[N]`` never retries)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"pyspark is not installed ({exc}); make test installs the [spark] extra")
        pytest.skip(f"pyspark is not installed: {exc}")
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers crash on another interpreter
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (SparkSession.builder.master("local[2,3]").appName("idembus-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def postgres_storage() -> Iterator[PostgresStorage]:
    """A PostgresStorage with tables of its own, dropped afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"pf{uuid.uuid4().hex[:10]}"
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.verify()
    yield storage
    storage.close()  # an endpoint may have closed it already
    cleaner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    cleaner.drop_tables()
    cleaner.close()


@pytest.fixture
def rabbitmq(unique: str) -> Iterator[tuple[KombuTransport, Callable[[str], str]]]:
    """A RabbitMQ transport with its own events exchange, and ``name(prefix)`` giving queue
    names unique to the test; the queues and the exchange are deleted afterwards."""
    require_service(AMQP_URL, "RabbitMQ")
    transport = KombuTransport(AMQP_URL, exchange=f"test-events-{unique}")
    names: list[str] = []

    def name(prefix: str) -> str:
        names.append(f"{prefix}-{unique}")
        return names[-1]

    yield transport, name
    transport.close()  # an endpoint may have closed it already
    cleaner = KombuTransport(AMQP_URL, exchange=f"test-events-{unique}")
    for queue in names:
        cleaner.delete_queue(queue)
    cleaner.delete_exchange()
    cleaner.close()
