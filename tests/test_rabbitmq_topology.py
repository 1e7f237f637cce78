"""An endpoint whose RabbitMQ topology differs from what it would declare — its queue, or
the delay levels — does not start: ``idembus run`` exits 2 with one line saying what
differs and what to change, before it consumes anything (not at the first delayed retry
in the middle of a run)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from idembus.transports import delays
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, require_service
from tests.hostile import plain_amqp

pytestmark = pytest.mark.amqp
ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Exit status of ``idembus run`` for a configuration error.
EXIT_CONFIGURATION = 2

APP = textwrap.dedent('''
    import os

    from idembus import Endpoint
    from idembus.transports import delays
    from idembus.transports.kombu import KombuTransport
    from tests.support import AccountHandler


    def make() -> Endpoint:
        transport = KombuTransport(os.environ["APP_TRANSPORT"])
        if os.environ.get("APP_DELAY_PREFIX"):
            # The test's own delay levels: the shared ones stay as they are.
            transport._delay_levels = delays.Topology(os.environ["APP_DELAY_PREFIX"], True)
        return Endpoint(os.environ["APP_QUEUE"], transport=transport,
                        error_queue=os.environ["APP_QUEUE"] + "-error",
                        handlers=[AccountHandler])
''')


@pytest.fixture
def names(unique: str) -> Iterator[tuple[str, delays.Topology]]:
    """This test's queue and delay levels, deleted afterwards."""
    require_service(AMQP_URL, "RabbitMQ")
    queue = f"topology-{unique}"
    levels = delays.Topology(f"test-{unique}.qdelay", quorum=True)
    yield queue, levels
    cleaner = KombuTransport(AMQP_URL, queue_type="classic")
    for name in (queue, f"{queue}-error"):
        cleaner.delete_queue(name)
    cleaner.close()
    with plain_amqp(AMQP_URL) as channel:
        for level in levels.levels():
            channel.queue_delete(level.name)
            channel.exchange_delete(level.name)
        channel.queue_delete(levels.undeliverable)
        for exchange in (levels.deliver_exchange, levels.undeliverable):
            channel.exchange_delete(exchange)


def run_endpoint(tmp_path: pathlib.Path, queue: str, delay_prefix: str) -> tuple[int, str]:
    """``idembus run`` the app in its own process; its exit status and standard error."""
    (tmp_path / "topology_app.py").write_text(APP)
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "APP_QUEUE": queue,
                   "APP_TRANSPORT": AMQP_URL, "APP_DELAY_PREFIX": delay_prefix}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "idembus", "run", "topology_app:make"], cwd=tmp_path,
            env=environment, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as running:
        pytest.fail(f"the endpoint started and ran: {running.stderr!r}")
    return done.returncode, done.stderr


def said(stderr: str) -> list[str]:
    """The lines of ``idembus run``'s own message (not logging)."""
    return [line for line in stderr.splitlines() if line.startswith("idembus: ")]


def test_an_endpoint_whose_queue_exists_as_another_type_exits_2_saying_what_to_change(
    tmp_path: pathlib.Path, names: tuple[str, delays.Topology],
) -> None:
    # Given the endpoint's queue, declared as a classic queue by an older deployment
    queue, levels = names
    classic = KombuTransport(AMQP_URL, queue_type="classic")
    classic.declare(queue)
    classic.close()

    # When the endpoint (quorum queues by default) is run
    status, stderr = run_endpoint(tmp_path, queue, levels.prefix)

    # Then it exits 2 with one line naming the queue, the argument and the option
    assert status == EXIT_CONFIGURATION, stderr
    lines = said(stderr)
    assert len(lines) == 1, stderr
    assert f"queue {queue!r} exists" in lines[0]
    assert "x-queue-type" in lines[0] and "queue_type=" in lines[0]
    assert "Traceback" not in stderr


def test_an_endpoint_on_delay_levels_declared_otherwise_exits_2_at_start(
    tmp_path: pathlib.Path, names: tuple[str, delays.Topology],
) -> None:
    # Given delay levels whose delivery exchange an older idembus declared without an
    # alternate exchange
    queue, levels = names
    with plain_amqp(AMQP_URL) as channel:
        channel.exchange_declare(levels.deliver_exchange, "topic", durable=True,
                                 auto_delete=False)

    # When the endpoint is run
    status, stderr = run_endpoint(tmp_path, queue, levels.prefix)

    # Then it does not start: exit 2, one line naming the exchange and what to do
    assert status == EXIT_CONFIGURATION, stderr
    lines = said(stderr)
    assert len(lines) == 1, stderr
    assert f"exchange {levels.deliver_exchange!r}" in lines[0]
    assert "alternate-exchange" in lines[0]
    assert f"delete the {levels.prefix}.* queues and exchanges" in lines[0]
    assert "Traceback" not in stderr
