"""Replay on a real Spark standalone cluster, one executor SIGKILLed mid-job (issue 15,
point 8).

A master and two workers (1 core each) run on 127.0.0.1, started with the pyspark package's
``bin/spark-class`` (:class:`bench.spark_cluster.StandaloneCluster`); ``idembus spark replay
--master spark://...`` runs as a driver process of its own, as a user would run it: the
endpoint's module (``tests/spark_endpoints.py``) goes to the executors with ``--py-files``,
and the configuration it reads from the environment (the test's queues and tables) with
``--conf spark.executorEnv.IDEMBUS_SPARK_WORLD=...``: the executors are started by the
workers and inherit nothing from the driver.

Which process is killed: the **executor JVM** of one worker, while it runs its task. That
is what losing an executor or its machine looks like to Spark: the driver hears of it from
the master, the task runs again on another executor (the master starts a new one), and
the shuffle files the dead executor held are gone too, so when it held the map output the
scheduler runs the map stage again and may start the other partition again while its first
attempt still runs: two attempts of one partition overlap. The dead executor's Python
worker is stopped by its pyspark daemon within about a second, wherever it was (in a
handler, in a commit, after a send before its mark). Killing only the Python worker would
be an ordinary task failure, retried on the same executor with its shuffle files intact,
the kind the local-mode tests of ``tests/test_spark_replay.py`` already cover.

Size: ``make soak`` replays 2,000 messages (100 aggregates x 20 steps) and kills when 400
are applied; ``IDEMBUS_SPARK_CLUSTER_MESSAGES=10000`` runs the issue's 10,000.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench.pg_procs import Workers
from bench.spark_cluster import StandaloneCluster
from idembus.cli import main
from tests.conftest import AMQP_URL, IN_CI, POSTGRES_URL, require_service
from tests.spark_endpoints import WORLD_VARIABLE, SparkWorld
from tests.test_spark_replay import (
    Message,
    Replaying,
    bodies_by_id,
    expected_trails,
    helpers_archive,
    make_messages,
)

AGGREGATES = 100
MESSAGES = int(os.environ.get("IDEMBUS_SPARK_CLUSTER_MESSAGES", "2000"))
STEPS = MESSAGES // AGGREGATES
#: The executor is killed once this many messages are applied (a fifth of them).
KILL_AFTER = MESSAGES // 5
#: The longest a replay may take, kill and retries included.
DRIVER_TIMEOUT = 600.0
SUMMARY = re.compile(r"replayed=\d+(?: \w+=\d+)+")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[StandaloneCluster]:
    """A master and two 1-core workers on loopback, logs under the test's directory,
    stopped (executors included) whatever the test did."""
    require_service(POSTGRES_URL, "PostgreSQL")
    require_service(AMQP_URL, "RabbitMQ")
    missing = [what for what, found in (("java", shutil.which("java")),
                                        ("pyspark", _importable("pyspark"))) if not found]
    if missing:
        reason = f"a Spark cluster needs {' and '.join(missing)}"
        if IN_CI:
            pytest.fail(f"{reason}; make test installs the [spark] extra, Java 17 is needed")
        pytest.skip(reason)
    with StandaloneCluster(tmp_path / "cluster", workers=2, cores=1, memory="1g") as running:
        yield running


@pytest.fixture
def replaying(unique: str) -> Iterator[Replaying]:
    world = SparkWorld(suffix=unique, amqp_url=AMQP_URL, postgres_url=POSTGRES_URL)
    made = Replaying(world, "tests.spark_endpoints:endpoint_from_environment", spark=None)
    yield made
    made.close()


@pytest.mark.postgres
@pytest.mark.amqp
@pytest.mark.slow  # a soak (make soak): a cluster of three JVMs, two minutes on 2 cores
@pytest.mark.timeout(900)
def test_a_replay_on_a_cluster_applies_each_message_once_though_an_executor_is_killed_mid_job(
        cluster: StandaloneCluster, replaying: Replaying, tmp_path: Path, unique: str) -> None:
    # Given MESSAGES steps of 100 aggregates in a JSON lines file, shuffled, an endpoint
    # configured by its environment, and its module zipped for the executors
    messages = make_messages(unique, aggregates=AGGREGATES, steps=STEPS)
    archive = tmp_path / "messages.json"
    write_json_lines(archive, messages)
    world = replaying.world.to_json()

    # When idembus spark replay runs on the cluster (from a directory where the module is
    # not), and the busiest executor is SIGKILLed once the database shows a fifth of the
    # messages applied
    driver = Workers(
        [sys.executable, "-m", "idembus", "spark", "replay", replaying.reference, str(archive),
         "--master", cluster.master_url, "--partitions", "2",
         "--py-files", str(helpers_archive(tmp_path)),
         "--conf", f"spark.executorEnv.{WORLD_VARIABLE}={world}",
         "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.locality.wait=0",
         "--conf", "spark.ui.showConsoleProgress=false", "--log-level", "WARNING"],
        environment=cluster.environment({WORLD_VARIABLE: world}), log=tmp_path / "driver.log",
        cwd=tmp_path)
    with driver:
        applied_at_kill, victim = kill_an_executor_mid_job(cluster, driver, replaying)
        driver.process.wait(DRIVER_TIMEOUT)
        status = driver.process.returncode

    # Then the job succeeded: every message replayed, those the killed attempt committed
    # found committed by the task that ran again, nothing dead-lettered
    output = driver.log.read_text(errors="replace")
    assert status == 0, f"the driver exited with {status}:\n{driver.log_tail(40)}"
    assert KILL_AFTER <= applied_at_kill < MESSAGES
    assert not Path(f"/proc/{victim}").exists()
    summary = summary_of(output)
    assert summary["replayed"] == MESSAGES
    assert summary["handled"] + summary["duplicates"] == MESSAGES
    assert summary["duplicates"] >= 1, "no task ran again over committed messages"
    assert summary["dead_lettered"] == summary["retried_later"] == summary["unsettled"] == 0
    # ...each aggregate got each of its steps once, in order...
    assert replaying.trails() == expected_trails(AGGREGATES, STEPS)
    # ...one processed record per message, every one marked dispatched...
    assert processed_records(replaying) == (MESSAGES, 0)
    # ...and every outgoing event left with its deterministic id; a copy sent again by an
    # attempt that overlapped another carries the same id and the same body.
    by_id = bodies_by_id(replaying.drain())
    assert set(by_id) == replaying.expected_ids(messages)
    assert all(len(bodies) == 1 for bodies in by_id.values())


def test_a_spark_property_that_is_not_key_equals_value_is_refused_with_an_example(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["spark", "replay", "shop:endpoint", "messages.json",
              "--conf", "spark.executor.memory"])

    assert refused.value.code == 2
    error = capsys.readouterr().err
    assert "'spark.executor.memory' is not KEY=VALUE" in error
    assert "--conf spark.executorEnv." in error


def test_a_py_file_that_does_not_exist_is_refused_before_spark_starts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    missing = tmp_path / "shop.py"

    status = main(["spark", "replay", "shop:endpoint", str(tmp_path / "messages.json"),
                   "--master", "spark://127.0.0.1:1", "--py-files", f"{missing},"])

    assert status == 2
    assert f"no such file to ship to the executors (--py-files): {missing}" in (
        capsys.readouterr().err)


def kill_an_executor_mid_job(cluster: StandaloneCluster, driver: Workers,
                             replaying: Replaying) -> tuple[int, int]:
    """Wait until the storage holds KILL_AFTER processed records, then SIGKILL the executor
    that has done the most of them; (records applied at that moment, the executor's pid).
    Fails if the driver exits first."""
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        while (applied := _processed(connection, replaying)[0]) < KILL_AFTER:
            try:
                driver.process.wait(0.05)  # the poll interval, ended early by the driver's exit
            except subprocess.TimeoutExpired:
                continue
            pytest.fail(f"the driver exited ({driver.process.returncode}) before {KILL_AFTER} "
                        f"messages were applied:\n{driver.log_tail(40)}")
        # The executor that has worked the most: with a fifth applied and no partition
        # near its end (100 aggregates hash into two of about 1,000 messages each), its
        # task is running and has committed messages that its next attempt finds done.
        victim = cluster.kill_executor(cluster.busiest_worker())
        return applied, victim


def processed_records(replaying: Replaying) -> tuple[int, int]:
    """(processed records, those whose outgoing messages are not marked dispatched)."""
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        return _processed(connection, replaying)


def _processed(connection: psycopg.Connection[Any], replaying: Replaying) -> tuple[int, int]:
    row = connection.execute(
        "SELECT count(*), count(*) FILTER (WHERE NOT dispatched) "
        f"FROM {replaying.world.table_prefix}_processed").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def write_json_lines(path: Path, messages: list[Message]) -> None:
    with open(path, "w") as lines:
        for message in messages:
            lines.write(json.dumps({
                "message_id": message.message_id, "message_type": "spark.Step",
                "body": message.body, "aggregate_id": message.aggregate,
                "sequence": message.sequence}) + "\n")


def summary_of(output: str) -> dict[str, int]:
    """The ``replayed=... handled=...`` line the command printed, as numbers."""
    found = SUMMARY.findall(output)
    assert found, f"no summary line in the driver's output:\n{output[-3000:]}"
    return {key: int(value) for key, value in (part.split("=") for part in found[-1].split())}


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
