"""``idembus run --workers 2 --metrics-port P`` on RabbitMQ and PostgreSQL: the supervisor
serves one ``/metrics`` whose counters are the sum of its workers', and a worker killed with
SIGKILL and restarted takes nothing away from them."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import uuid
from collections.abc import Iterator

import pytest

from tests.support import Deposit
from tests.test_metrics_port import scrape, total
from tests.test_workers import APP, App, Running, children, deployed, wait_until

pytestmark = [pytest.mark.amqp, pytest.mark.postgres, pytest.mark.timeout(240)]

SERVING = re.compile(r"serving metrics for Prometheus at http://[^:]+:(\d+)/metrics")
HANDLED = "idembus_messages_handled_total"


@pytest.fixture
def app(tmp_path: pathlib.Path) -> Iterator[App]:
    with deployed(tmp_path, APP, name="workers-metrics", prefix="wm") as made:
        yield made


def metrics_port(supervisor: Running) -> int:
    assert supervisor.err.wait_for("serving metrics for Prometheus at"), supervisor.err.lines
    [port] = [int(found.group(1)) for line in supervisor.err.lines
              if (found := SERVING.search(line))]
    return port


def json_lines(running: Running) -> list[dict[str, object]]:
    """The JSON log lines ``running`` wrote so far (its supervisor's and its workers')."""
    lines = []
    for line in list(running.err.lines):
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a traceback's line
    return lines


def handled(port: int, queue: str) -> float:
    return total(scrape(port), HANDLED, endpoint=queue, handler="Accounts")


def send(app: App, count: int) -> None:
    for number in range(count):
        app.send(Deposit(account=f"acct-{number}", amount=1), message_id=str(uuid.uuid4()))


def test_two_workers_serve_one_metrics_endpoint_whose_counts_add_up_across_kills(app):
    # Given a supervisor of two workers, both consuming, serving metrics on a free port
    supervisor = app.start("--workers", "2", "--metrics-port", "0", "--log-format", "json",
                           "--log-per-message")
    port = metrics_port(supervisor)
    assert supervisor.err.wait_for(", 1 consumer(s), ", count=2), supervisor.err.lines[-20:]

    # When 40 deposits are handled, by both workers
    send(app, 40)
    assert supervisor.err.wait_for('"outcome": "handled"', count=40), supervisor.err.lines[-9:]
    workers = {(str(line["worker"]), str(line["pid"])) for line in json_lines(supervisor)
               if line.get("outcome") == "handled"}
    assert {pid for _, pid in workers} == {str(pid) for pid in children(supervisor.process.pid)}
    assert len(workers) == 2

    # Then one scrape of the supervisor shows 40 handled (the workers write their figures
    # every second: poll until the last ones are in)
    assert wait_until(lambda: handled(port, app.queue) == 40, timeout=30)
    samples = scrape(port)
    assert total(samples, "idembus_messages_received_total", endpoint=app.queue) == 40
    assert total(samples, "idembus_message_handling_duration_seconds_count",
                 endpoint=app.queue, outcome="handled") == 40
    # And the gauges are one per worker, labelled with its index and pid
    in_flight = samples["idembus_messages_in_flight"]
    assert {(s.labels["worker"], s.labels["pid"]) for s in in_flight} == workers
    assert all("worker" not in sample.labels for sample in samples[HANDLED])

    # When a worker is killed with SIGKILL and the supervisor restarts it
    victim = int(min(pid for _, pid in workers))
    os.kill(victim, signal.SIGKILL)
    seen = []
    for _ in range(150):  # scrapes while the worker is dead, until the supervisor notices
        seen.append(handled(port, app.queue))
        if supervisor.err.wait_for("exited with status -9", timeout=0.2):
            break
    assert supervisor.err.wait_for("exited with status -9"), supervisor.err.lines[-20:]
    assert supervisor.err.wait_for(", 1 consumer(s), ", count=3), supervisor.err.lines[-20:]
    seen.append(handled(port, app.queue))

    # Then the total never dropped below 40, the dead process's gauges are gone and its
    # replacement's are there
    assert seen and min(seen) == 40, seen
    pids = {sample.labels["pid"] for sample in scrape(port)["process_start_time_seconds"]}
    assert str(victim) not in pids
    assert pids == {str(pid) for pid in children(supervisor.process.pid)}

    # And 20 more deposits, handled by the workers there are now, add to it
    send(app, 20)
    assert wait_until(lambda: handled(port, app.queue) == 60, timeout=30)

    # And SIGTERM stops the workers and the server: exit 0
    supervisor.process.send_signal(signal.SIGTERM)
    assert supervisor.process.wait(timeout=60) == 0, supervisor.err.lines[-20:]
