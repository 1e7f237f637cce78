"""A rate limit shared by two worker processes (``idembus run --workers 2``) on RabbitMQ
and PostgreSQL: the rate holds across both, and no message reaches the error queue."""

from __future__ import annotations

import pathlib
import textwrap
from collections.abc import Iterator

import psycopg
import pytest

from tests.conftest import POSTGRES_URL
from tests.support import Deposit
from tests.test_workers import App, deployed, wait_until

pytestmark = [pytest.mark.amqp, pytest.mark.postgres]

APP = textwrap.dedent('''
    import os
    import time

    from pydantic import BaseModel

    from idembus import Endpoint, Limits, RateLimit
    from idembus.handlers import AggregateHandler, handles
    from idembus.storage.postgres import PostgresStorage
    from tests.support import Deposit


    class Stamp(BaseModel):
        at: float = 0.0
        pid: int = 0


    class Stamps(AggregateHandler[Stamp]):
        def aggregate_id(self, message: Deposit) -> str:
            return message.account

        @handles
        def deposit(self, message: Deposit) -> None:
            self.state.at = time.time()
            self.state.pid = os.getpid()


    def make() -> Endpoint:
        return Endpoint(
            os.environ["APP_QUEUE"],
            transport=os.environ["APP_TRANSPORT"],
            storage=PostgresStorage(os.environ["APP_POSTGRES"],
                                    table_prefix=os.environ["APP_PREFIX"]),
            handlers=[Stamps],
            error_queue=os.environ["APP_ERROR_QUEUE"],
            middleware=[Limits(RateLimit(per_second=5, types=(Deposit,)))],
            concurrency=2,
        )
''')

RATE = 5
WINDOW = 20.0
MESSAGES = 135  # the backlog outlasts the window: 27 s at 5 a second


@pytest.fixture
def app(tmp_path: pathlib.Path) -> Iterator[App]:
    with deployed(tmp_path, APP, name="limits", prefix="lim") as made:
        yield made


def stamps(app: App) -> list[tuple[float, int]]:
    with psycopg.connect(POSTGRES_URL) as connection:
        rows = connection.execute(
            f"SELECT state FROM {app.prefix}_aggregates WHERE state IS NOT NULL").fetchall()
    return sorted((row[0]["at"], row[0]["pid"]) for row in rows if row[0]["at"])


@pytest.mark.timeout(180)
def test_a_rate_limit_holds_across_two_worker_processes(app: App) -> None:
    # Given a backlog of deposits, one aggregate each
    for number in range(MESSAGES):
        app.send(Deposit(account=f"a{number}", amount=1))
    # When two worker processes with a limit of 5 a second share it
    running = app.start("--workers", "2")
    assert wait_until(lambda: len(stamps(app)) >= MESSAGES, timeout=120), \
        "\n".join(running.err.lines[-20:])
    handled = stamps(app)
    running.stop()
    # Then over 20 seconds, 5 a second were handled, within 10 %. The window starts a
    # second after the first message: a batch's first message runs once the batch has
    # reserved its slots, and RabbitMQ brings the messages of the first second back
    # together, a second later (it delays in whole seconds)
    start = handled[0][0] + 1.0
    in_window = [at for at, _ in handled if start <= at < start + WINDOW]
    assert RATE * WINDOW * 0.9 <= len(in_window) <= RATE * WINDOW * 1.1, len(in_window)
    # by both workers, and nothing went to the error queue
    assert len({pid for _, pid in handled}) == 2
    assert app.transport.get(app.error_queue) is None
    assert len(handled) == MESSAGES
