"""The cluster torture test (``python -m samples.torture --cluster``) in a reduced size.

Three RabbitMQ nodes and a PostgreSQL primary with a synchronous standby, all started by the
run on loopback ports of their own (the machine's RabbitMQ and PostgreSQL are not touched);
the ordering sample's endpoints, two worker processes each, reach them through a failover
URL and a multi-host conninfo. Halfway through the orders the node leading the most quorum
queues is SIGKILLed; while it is down the PostgreSQL primary is SIGKILLed and the standby
promoted; the node is started again, then a node is stopped gracefully and started again;
workers are SIGKILLed throughout. The line is read from the stores of the surviving
database (the promoted standby), not from the endpoints' counters.

The run took about two minutes on a busy two-core machine (a node takes 15 to 90 s to
boot there, and two are started again), so it runs in ``make test``; ``make soak`` runs the
larger ``make torture-cluster``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from idembus.testing.pg_cluster import ClusterError, server_programs
from tests.conftest import IN_CI
from tests.test_torture import run_torture

pytestmark = [pytest.mark.amqp, pytest.mark.postgres, pytest.mark.torture,
              pytest.mark.timeout(1200)]
ORDERS = 300
FIELDS = ["orders", "placed", "billed", "shipped", "charges", "kills", "broker_restarts",
          "node_kills", "node_stops", "pg_failovers", "error_queue", "lost", "double_effects",
          "history_violations"]


def require_servers() -> None:
    """Skip (locally) or fail (under CI=true) unless RabbitMQ's and PostgreSQL's server
    programs are installed."""
    missing = []
    if shutil.which("rabbitmq-server") is None and not os.path.exists(
            "/usr/lib/rabbitmq/bin/rabbitmq-server"):
        missing.append("rabbitmq-server is not installed")
    try:
        server_programs()
    except ClusterError as error:
        missing.append(str(error))
    if not missing:
        return
    if IN_CI:
        pytest.fail(f"{'; '.join(missing)}; under CI=true the cluster torture must run")
    pytest.skip("; ".join(missing))


def test_every_order_takes_effect_once_through_a_node_kill_a_node_stop_and_a_pg_failover():
    require_servers()

    # When 300 orders (20% of them sent twice) go through the three endpoints on the
    # cluster and the pair, a node killed and PostgreSQL failed over halfway, a node
    # stopped after, and a random worker SIGKILLed every ~1.5 s (at 4 s, the batched
    # workers shipped every order before the first kill)
    done = run_torture("--cluster", "--orders", str(ORDERS), "--duplicates", "0.2",
                       "--workers", "2", "--kill-interval", "1.5", "--seed", "5",
                       "--timeout", "700", timeout=900)

    # Then every order was placed, billed, charged and shipped exactly once in the
    # surviving database, nothing is in the error queue, and each disruption happened
    (line,) = done.stdout.strip().splitlines()
    fields = dict(part.split("=") for part in line.split())
    assert list(fields) == FIELDS, line
    figures = {name: int(value) for name, value in fields.items()}
    diagnosis = f"{line}\n{done.stderr[-4000:]}"
    assert all(figures[name] == ORDERS for name in ("orders", "placed", "billed", "shipped",
                                                    "charges")), diagnosis
    assert figures["error_queue"] == figures["lost"] == figures["double_effects"] == 0, diagnosis
    assert figures["history_violations"] == 0, diagnosis
    assert figures["node_kills"] == figures["node_stops"] == figures["pg_failovers"] == 1, \
        diagnosis
    assert figures["kills"] > 0, diagnosis
    assert done.returncode == 0, diagnosis
    assert "standby promoted after" in done.stderr, diagnosis
