"""The endpoint of the schedule race test (``tests/test_schedules_race.py``), run in several
processes by ``idembus run`` (``tests.test_workers.App``: its settings come in ``APP_*``
environment variables).

Every second its scheduler sends a :class:`Tick` to the endpoint itself; the message names
the process that built it. The handler keeps one aggregate per occurrence, counting how
often that occurrence's effect was applied and with which message ids.
"""

from __future__ import annotations

import datetime
import os

from pydantic import BaseModel, Field

from idembus import Command, Endpoint, OutboxPolicy
from idembus.envelope import format_utc
from idembus.handlers import AggregateHandler, handles
from idembus.schedules import Schedule, SchedulerPolicy
from idembus.storage.postgres import PostgresStorage

#: The schedule's name (occurrence ids derive from it).
SCHEDULE = "tick"


class Tick(Command, message_name="race.Tick"):
    at: str
    #: The process whose scheduler built the message.
    pid: int


class Tally(BaseModel):
    handled: int = 0
    message_ids: list[str] = Field(default_factory=list)
    pid: int = 0


class Ticks(AggregateHandler[Tally]):
    def aggregate_id(self, message: Tick) -> str:
        return message.at

    @handles
    def tick(self, message: Tick) -> None:
        self.state.handled += 1
        self.state.message_ids.append(self.context.message_id)
        self.state.pid = message.pid


def tick(occurrence: datetime.datetime) -> Tick:
    return Tick(at=format_utc(occurrence), pid=os.getpid())


def make() -> Endpoint:
    endpoint = Endpoint(
        os.environ["APP_QUEUE"],
        transport=os.environ["APP_TRANSPORT"],
        storage=PostgresStorage(os.environ["APP_POSTGRES"],
                                table_prefix=os.environ["APP_PREFIX"]),
        handlers=[Ticks],
        error_queue=os.environ["APP_ERROR_QUEUE"],
        outbox=OutboxPolicy(grace=1.0),
        schedules=SchedulerPolicy(
            [Schedule(SCHEDULE, cron="* * * * * *", message=tick, catch_up=True)],
            lease_ttl=2.0),
        status_interval=1.0,
    )
    # A killed process's outbox lease passes on within seconds too (30 s by default).
    endpoint.outbox.lease_ttl = 2.0
    return endpoint
