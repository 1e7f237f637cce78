"""The endpoints of the Spark replay tests, built inside Spark's worker processes.

Workers import this module by name, so it holds no test state: everything a test varies
(its queues, exchange and tables, which message crashes) travels in a :class:`SparkWorld`,
written as JSON into a small module generated per test and shipped to the workers
(``tests/test_spark_replay.py``), or into the environment variable :data:`WORLD_VARIABLE`,
which a cluster's executors get as ``spark.executorEnv.IDEMBUS_SPARK_WORLD``
(``tests/test_spark_cluster.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from idembus import Command, Endpoint, Event, upcaster
from idembus.handlers import AggregateHandler, handles
from idembus.storage.postgres import PostgresStorage
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from idembus.transports.kombu import KombuTransport


class Step(Command, message_name="spark.Step"):
    aggregate: str
    sequence: int


class Stepped(Event, message_name="spark.Stepped"):
    aggregate: str
    sequence: int


class Trail(BaseModel):
    """The sequence numbers of an aggregate's steps, in the order they were applied."""

    sequences: list[int] = Field(default_factory=list)


class TrailHandler(AggregateHandler[Trail]):
    """Records each step's sequence number and publishes Stepped; fails on a negative one."""

    def aggregate_id(self, message: Step) -> str:
        return message.aggregate

    @handles
    def step(self, message: Step) -> None:
        if message.sequence < 0:
            raise ValueError(f"step {message.sequence} of {message.aggregate} is negative")
        self.state.sequences.append(message.sequence)
        self.bus.publish(Stepped(aggregate=message.aggregate, sequence=message.sequence))


class Moved(Command, message_name="spark.Moved", message_version=2):
    """Version 2 of a move, in metres. Version 1 said ``{"aggregate", "sequence", "km"}``."""

    aggregate: str
    sequence: int
    metres: int


@upcaster(Moved, from_version=1)
def _kilometres_to_metres(body: dict[str, Any]) -> dict[str, Any]:
    return {"aggregate": body["aggregate"], "sequence": body["sequence"],
            "metres": round(body["km"] * 1000)}


class Odometer(BaseModel):
    """The metres of an aggregate's moves, in the order they were applied."""

    metres: list[int] = Field(default_factory=list)


class OdometerHandler(AggregateHandler[Odometer]):
    """Version 2 handlers: record each move's metres."""

    def aggregate_id(self, message: Moved) -> str:
        return message.aggregate

    @handles
    def move(self, message: Moved) -> None:
        self.state.metres.append(message.metres)


@dataclass(frozen=True)
class SparkWorld:
    """Where one test's messages and rows live, and the crash it injects, if any."""

    suffix: str
    amqp_url: str
    postgres_url: str
    #: Crash after committing this message, on the first attempt of its task only...
    crash_message_id: str | None = None
    #: ...and leave a file here saying so.
    crash_marker: str | None = None
    #: The endpoint's handlers: ``"trail"`` (:class:`TrailHandler`) or ``"odometer"``
    #: (:class:`OdometerHandler`, of version-2 messages).
    handlers: str = "trail"

    @property
    def name(self) -> str:
        return f"spark-{self.suffix}"

    @property
    def error_queue(self) -> str:
        return f"spark-error-{self.suffix}"

    @property
    def observer_queue(self) -> str:
        """A queue subscribed to Stepped: where the replay's outgoing events arrive."""
        return f"spark-observer-{self.suffix}"

    @property
    def exchange(self) -> str:
        return f"spark-events-{self.suffix}"

    @property
    def table_prefix(self) -> str:
        return f"tspark_{self.suffix}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def storage(self) -> PostgresStorage:
        return PostgresStorage(self.postgres_url, table_prefix=self.table_prefix, pool_size=2)

    def transport(self) -> KombuTransport:
        return KombuTransport(self.amqp_url, exchange=self.exchange)


class CrashOnFirstAttempt(FaultInjector):
    """Dies (``SimulatedCrash``) right after committing one message, only in the first
    attempt of the Spark task processing it: the retried task then gets through."""

    def __init__(self, message_id: str, marker: Path) -> None:
        self.message_id = message_id
        self.marker = marker

    def reached(self, point: CrashPoint, message_id: str) -> None:
        from pyspark import TaskContext

        if point is not CrashPoint.AFTER_COMMIT or message_id != self.message_id:
            return
        context = TaskContext.get()
        if context is not None and context.attemptNumber() == 0:
            self.marker.write_text(f"partition {context.partitionId()}\n")
            raise SimulatedCrash(f"simulated crash after committing {message_id}")


def build_endpoint(world_json: str) -> Endpoint:
    """The endpoint of the world described by ``world_json`` (a :meth:`SparkWorld.to_json`)."""
    world = SparkWorld(**json.loads(world_json))
    crash = None
    if world.crash_message_id is not None and world.crash_marker is not None:
        crash = CrashOnFirstAttempt(world.crash_message_id, Path(world.crash_marker))
    handler = OdometerHandler if world.handlers == "odometer" else TrailHandler
    return Endpoint(world.name, transport=world.transport(), storage=world.storage(),
                    handlers=[handler], error_queue=world.error_queue, outbox=False,
                    middleware=[crash] if crash is not None else [])


#: The environment variable :func:`endpoint_from_environment` reads a world from.
WORLD_VARIABLE = "IDEMBUS_SPARK_WORLD"


def endpoint_from_environment() -> Endpoint:
    """The endpoint of the world in the environment (:data:`WORLD_VARIABLE`), as an
    application configured by its environment builds its own."""
    return build_endpoint(os.environ[WORLD_VARIABLE])


def process_local_endpoint() -> Endpoint:
    """An endpoint on memory:// and mongomock, which a replay must refuse."""
    return Endpoint("spark-process-local", handlers=[TrailHandler])
