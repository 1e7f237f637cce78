"""The exactly-once torture test (``samples/torture``) in a size that fits CI.

``make torture`` runs it with 10,000 orders; here 2,000 orders go through the ordering sample
on RabbitMQ and PostgreSQL with three worker processes per endpoint, a worker SIGKILLed
every ~2 s and RabbitMQ restarted once (``rabbitmqctl stop_app`` / ``start_app``: other
users of the broker lose their connections for a few seconds); and again with the queues in
PostgreSQL (the PostgreSQL transport, commit + send + ack in one transaction), the cluster
restarted once with ``pg_ctlcluster`` (every user of that cluster loses its connections:
``IDEMBUS_TORTURE_POSTGRES_URL`` points this run at a cluster of its own).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from samples.torture.postgres import PgCtlcluster
from samples.torture.rabbitmq import Rabbitmqctl
from tests.conftest import AMQP_URL, IN_CI, POSTGRES_URL, require_service

#: A run may take its 240 s and 120 s more to unwind (run_torture) before it fails.
pytestmark = [pytest.mark.postgres, pytest.mark.torture, pytest.mark.timeout(480)]
#: The database of the run on the PostgreSQL transport, whose cluster it restarts.
TORTURE_POSTGRES_URL = os.environ.get("IDEMBUS_TORTURE_POSTGRES_URL", POSTGRES_URL)
ROOT = pathlib.Path(__file__).resolve().parent.parent
ORDERS = 2000
FIELDS = ["orders", "placed", "billed", "shipped", "charges", "kills", "broker_restarts",
          "error_queue", "lost", "double_effects",
          "history_violations"]


def require_control(control: Rabbitmqctl | PgCtlcluster, reason: str) -> None:
    """Skip (locally) or fail (under CI=true) unless ``control`` can restart the broker."""
    if control.usable():
        return
    if IN_CI:
        pytest.fail(f"{reason}; under CI=true the torture test must run")
    pytest.skip(reason)


def run_torture(*arguments: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``python -m samples.torture`` in a session of its own; if it overruns, SIGTERM
    the session (the run unwinds: the broker is started, workers stopped, data dropped)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "samples.torture", *arguments], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            out, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        pytest.fail(f"the torture run took more than {timeout:.0f}s:\n{err[-4000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.mark.amqp
def test_every_order_takes_effect_once_while_workers_die_and_the_broker_restarts():
    require_service(AMQP_URL, "RabbitMQ")
    require_service(POSTGRES_URL, "PostgreSQL")
    rabbitmqctl = Rabbitmqctl()
    require_control(rabbitmqctl, "rabbitmqctl cannot reach the RabbitMQ node (run as root "
                                 "or the rabbitmq user)")

    # When 2,000 orders (20% of them sent twice) go through three endpoints of three workers
    # each, while a random worker is SIGKILLed every ~2 s and RabbitMQ restarts once
    done = None
    try:
        done = run_torture("--orders", str(ORDERS), "--duplicates", "0.2", "--workers", "3",
                           "--kill-interval", "2", "--broker-restart", "--seed", "3",
                           "--timeout", "150", "--transport", AMQP_URL,
                           "--postgres", POSTGRES_URL, timeout=240)
    finally:
        if done is None or done.returncode != 0:  # whatever happened, the broker runs again
            rabbitmqctl.start_app()
            rabbitmqctl.await_startup()

    # Then it prints one line read from the stores: every order placed, billed, charged and
    # shipped exactly once, nothing in the error queue, workers killed, the broker restarted
    assert_exactly_once(done)


def test_every_order_takes_effect_once_on_the_postgresql_transport_while_postgresql_restarts():
    require_service(TORTURE_POSTGRES_URL, "PostgreSQL")
    cluster = PgCtlcluster(TORTURE_POSTGRES_URL)
    require_control(cluster, "pg_ctlcluster cannot act on the cluster of "
                             "IDEMBUS_TORTURE_POSTGRES_URL (run as root or the postgres user)")

    # When 2,000 orders go through the three endpoints, their queues in PostgreSQL beside
    # their tables, while a random worker is SIGKILLed every ~2 s and the PostgreSQL
    # cluster is stopped and started once
    done = None
    try:
        done = run_torture("--orders", str(ORDERS), "--duplicates", "0.2", "--workers", "3",
                           "--kill-interval", "2", "--broker-restart", "--seed", "3",
                           "--timeout", "150", "--transport", TORTURE_POSTGRES_URL,
                           "--postgres", TORTURE_POSTGRES_URL, "--visibility-timeout", "5",
                           timeout=240)
    finally:
        if done is None or done.returncode != 0:  # whatever happened, PostgreSQL runs again
            cluster.start_app()
            cluster.await_startup()

    # Then every order took effect exactly once, as on RabbitMQ
    assert_exactly_once(done)


def assert_exactly_once(done: subprocess.CompletedProcess[str]) -> None:
    """The run's one line says that every order took effect exactly once, nothing is in the
    error queue, workers were killed and the broker restarted once."""
    (line,) = done.stdout.strip().splitlines()
    fields = dict(part.split("=") for part in line.split())
    assert list(fields) == FIELDS, line
    figures = {name: int(value) for name, value in fields.items()}
    diagnosis = f"{line}\n{done.stderr[-4000:]}"
    assert figures["orders"] == ORDERS, diagnosis
    assert all(figures[name] == ORDERS for name in ("placed", "billed", "shipped", "charges")), \
        diagnosis
    assert figures["error_queue"] == figures["lost"] == figures["double_effects"] == 0, diagnosis
    assert figures["history_violations"] == 0, diagnosis
    assert figures["kills"] > 0, diagnosis
    assert figures["broker_restarts"] == 1, diagnosis
    assert done.returncode == 0, diagnosis
