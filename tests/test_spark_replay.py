"""Replaying messages on Spark (idembus.spark.replay) through an endpoint on PostgreSQL and
RabbitMQ, on the shared ``local[2,3]`` session (tasks retried up to 3 times).

Spark's workers are separate processes that import the endpoint by reference. Each test
writes a module naming its own queues and tables (:class:`tests.spark_endpoints.SparkWorld`)
and ships it with ``addPyFile``; the handlers it uses, ``tests/spark_endpoints.py``, are
shipped once in a zip, so that workers find them whatever their working directory.
"""

from __future__ import annotations

import json
import os
import random
import uuid
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from idembus import headers as h
from idembus.cli import main
from idembus.context import MessageContext
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError
from idembus.spark.replay import ReplaySummary, foreach_batch_sink, replay
from idembus.storage.postgres import PostgresStorage
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.spark_endpoints import SparkWorld, Step, TrailHandler

pytestmark = [pytest.mark.postgres, pytest.mark.amqp]

SCHEMA = "message_id string, message_type string, body string, aggregate_id string, sequence long"
AGGREGATES = 6
STEPS = 10
_IDS = uuid.UUID("0b6e55f2-7a0c-4c55-9d44-5b1de3c0a7e1")


@dataclass(frozen=True)
class Message:
    """One input row: a Step of ``aggregate`` numbered ``sequence``."""

    message_id: str
    aggregate: str
    sequence: int
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def body(self) -> str:
        return Step(aggregate=self.aggregate, sequence=self.sequence).model_dump_json()

    def row(self) -> tuple[str, str, str, str, int]:
        return (self.message_id, "spark.Step", self.body, self.aggregate, self.sequence)


@dataclass
class Replaying:
    """One test's world as seen from the driver: its endpoint reference, its storage, and
    the queue its outgoing events reach."""

    world: SparkWorld
    reference: str
    spark: Any
    _storage: PostgresStorage = field(init=False)
    _transport: KombuTransport = field(init=False)

    def __post_init__(self) -> None:
        self._storage = self.world.storage()
        self._storage.verify()
        self._transport = self.world.transport()
        self._transport.declare(self.world.observer_queue, subscriptions=["spark.Stepped"])

    def frame(self, messages: Sequence[Message]) -> Any:
        return self.spark.createDataFrame([m.row() for m in messages], SCHEMA).repartition(3)

    def trails(self) -> dict[str, list[int]]:
        """Each aggregate's applied sequence numbers, in the order applied."""
        records = self._storage.records(TrailHandler.storage_name())
        return {record.aggregate_id: record.state["sequences"] for record in records}

    def expected_ids(self, messages: Sequence[Message]) -> set[str]:
        """The deterministic ids of the Stepped each message makes the handler publish."""
        return {MessageContext(message_id=m.message_id, message_type="spark.Step", headers={},
                               handler_name=TrailHandler.name(),
                               endpoint=self.world.name).outgoing_id(0) for m in messages}

    def drain(self, queue: str | None = None) -> list[Delivery]:
        """Every delivery waiting in ``queue`` (the observer queue by default)."""
        taken = []
        while (delivery := self._transport.get(queue or self.world.observer_queue)) is not None:
            taken.append(delivery)
        return taken

    def close(self) -> None:
        self._storage.drop_tables()
        self._storage.close()
        for queue in (self.world.name, self.world.error_queue, self.world.observer_queue):
            self._transport.delete_queue(queue)
        self._transport.delete_exchange()
        self._transport.close()


def make_messages(prefix: str, aggregates: int = AGGREGATES,
                  steps: int = STEPS) -> list[Message]:
    """Steps 0..steps-1 of each aggregate, shuffled: order must come from the replay."""
    messages = [Message(str(uuid.uuid5(_IDS, f"{prefix}/{a}/{s}")), f"agg-{a}", s)
                for a in range(aggregates) for s in range(steps)]
    random.Random(7).shuffle(messages)
    return messages


def bodies_by_id(deliveries: Sequence[Delivery]) -> dict[str, set[bytes]]:
    found: dict[str, set[bytes]] = defaultdict(set)
    for delivery in deliveries:
        found[delivery.headers[h.MESSAGE_ID]].add(delivery.body)
    return found


def expected_trails(aggregates: int = AGGREGATES, steps: int = STEPS) -> dict[str, list[int]]:
    return {f"agg-{a}": list(range(steps)) for a in range(aggregates)}


def helpers_archive(directory: Path) -> Path:
    """``tests.spark_endpoints`` in a zip for Spark's workers (``addPyFile``, ``--py-files``),
    so that they find it whatever their working directory."""
    tests = Path(__file__).parent
    archive = directory / "idembus_spark_test_helpers.zip"
    with zipfile.ZipFile(archive, "w") as bundle:
        for name in ("__init__.py", "spark_endpoints.py"):
            bundle.write(tests / name, f"tests/{name}")
    return archive


@pytest.fixture(scope="module")
def shipped_helpers(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``tests.spark_endpoints`` for the workers, in a zip on their path."""
    spark.sparkContext.addPyFile(str(helpers_archive(tmp_path_factory.mktemp("spark-helpers"))))


@pytest.fixture
def make_world(spark: Any, shipped_helpers: None, tmp_path: Path,
               unique: str) -> Iterator[Callable[..., Replaying]]:
    """``make_world(crash_message_id=...)``: a fresh world and its endpoint reference."""
    require_service(POSTGRES_URL, "PostgreSQL")
    require_service(AMQP_URL, "RabbitMQ")
    made: list[Replaying] = []

    def make(**options: Any) -> Replaying:
        world = SparkWorld(suffix=f"{unique}{len(made)}", amqp_url=AMQP_URL,
                           postgres_url=POSTGRES_URL, **options)
        module = f"idembus_spark_world_{world.suffix}"
        path = tmp_path / f"{module}.py"
        path.write_text(
            '"""The endpoint of one Spark replay test (generated)."""\n'
            "from tests.spark_endpoints import build_endpoint\n\n"
            f"WORLD = {world.to_json()!r}\n\n\n"
            "def endpoint():\n"
            "    return build_endpoint(WORLD)\n")
        spark.sparkContext.addPyFile(str(path))
        made.append(Replaying(world, f"{module}:endpoint", spark))
        return made[-1]

    yield make
    for replaying in made:
        replaying.close()


def test_replay_applies_each_message_once_in_order_and_sends_deterministic_ids(
        make_world, unique):
    replaying = make_world()
    messages = make_messages(unique)
    frame = replaying.frame(messages)

    summary = replay(frame, replaying.reference, partitions=3)

    assert summary == ReplaySummary(replayed=60, handled=60, partitions=summary.partitions)
    assert summary.ok and 1 <= summary.partitions <= 3
    assert summary.line().startswith("replayed=60 handled=60 duplicates=0 ")
    assert replaying.trails() == expected_trails()
    sent = bodies_by_id(replaying.drain())
    assert set(sent) == replaying.expected_ids(messages)
    assert all(len(bodies) == 1 for bodies in sent.values())

    again = replay(frame, replaying.reference, partitions=2)

    assert (again.replayed, again.handled, again.duplicates, again.redispatched) == (60, 0, 60, 0)
    assert replaying.trails() == expected_trails()
    assert replaying.drain() == []


def test_a_task_dying_after_committing_part_of_its_partition_applies_nothing_twice(
        make_world, tmp_path, unique):
    messages = make_messages(unique)
    # Step 5 of agg-0: its partition committed at least steps 0-4 of agg-0 before it.
    victim = next(m for m in messages if (m.aggregate, m.sequence) == ("agg-0", 5))
    marker = tmp_path / "crashed"
    replaying = make_world(crash_message_id=victim.message_id, crash_marker=str(marker))

    summary = replay(replaying.frame(messages), replaying.reference, partitions=2)

    assert marker.exists(), "the first attempt of the task should have crashed"
    assert summary.ok and summary.replayed == 60
    assert summary.handled + summary.duplicates == 60
    assert summary.duplicates >= 6  # the retried task found steps 0-5 of agg-0 committed
    assert summary.redispatched >= 1  # step 5's event: committed, not sent before the crash
    assert replaying.trails() == expected_trails()
    sent = replaying.drain()
    by_id = bodies_by_id(sent)
    assert set(by_id) == replaying.expected_ids(messages)
    assert all(len(bodies) == 1 for bodies in by_id.values())
    assert len(sent) >= 60


def test_foreach_batch_sink_applies_a_stream_and_a_batch_run_again_changes_nothing(
        make_world, spark, tmp_path, unique):
    replaying = make_world()
    messages = make_messages(unique)
    source = tmp_path / "stream"
    source.mkdir()
    for part in (0, 1):  # steps 0-4 arrive first, 5-9 later (shuffled within a file)
        with open(source / f"part-{part}.json", "w") as lines:
            for message in (m for m in messages if m.sequence // 5 == part):
                lines.write(json.dumps(dict(zip(
                    ("message_id", "message_type", "body", "aggregate_id", "sequence"),
                    message.row(), strict=True))) + "\n")
        arrived = 1_000_000_000 + part  # the file source takes the oldest file first
        os.utime(source / f"part-{part}.json", (arrived, arrived))
    sink = foreach_batch_sink(replaying.reference, partitions=2)
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(source))

    query = (stream.writeStream.foreachBatch(sink)
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(120), "the stream did not finish"

    assert query.exception() is None
    assert [batch_id for batch_id, _ in sink.batches] == [0, 1]
    assert sink.total.handled == 60 and sink.total.ok
    assert replaying.trails() == expected_trails()
    assert set(bodies_by_id(replaying.drain())) == replaying.expected_ids(messages)

    batch = spark.read.schema(SCHEMA).json(str(source / "part-0.json"))
    sink(batch, 0)
    sink(batch, 0)

    assert len(sink.batches) == 4
    for _, rerun in sink.batches[2:]:
        assert (rerun.replayed, rerun.handled, rerun.duplicates) == (30, 0, 30)
    assert replaying.trails() == expected_trails()
    assert replaying.drain() == []


def test_bad_rows_are_dead_lettered_failing_ones_retried_later_row_headers_kept(
        make_world, unique):
    replaying = make_world()
    good = Message(f"{unique}-good", "agg-0", 0, headers={h.CORRELATION_ID: "order-77"})
    # Exported from an error queue: its retries start again, as with `idembus errors retry`.
    from_error_queue = {h.DELAYED_ATTEMPTS: "3", h.FAILED_QUEUE: "elsewhere"}
    rows = [
        (good.message_id, "spark.Step", good.body, json.dumps(good.headers), "agg-0", 0),
        (f"{unique}-not-json", "spark.Step", "{not json", None, "agg-0", 1),
        (f"{unique}-unknown", "spark.Nothing", "{}", None, "agg-1", 0),
        (f"{unique}-bad-headers", "spark.Step", good.body, "[1, 2]", "agg-1", 1),
        (f"{unique}-failing", "spark.Step", Message("", "agg-2", -1).body,
         json.dumps(from_error_queue), "agg-2", -1),
    ]
    frame = replaying.spark.createDataFrame(rows, "message_id string, message_type string, "
                                                  "body string, headers string, "
                                                  "aggregate_id string, sequence long")

    summary = replay(frame, replaying.reference)

    assert (summary.replayed, summary.handled, summary.dead_lettered) == (5, 1, 3)
    assert summary.retried_later == 1  # the failing one, back to the endpoint's queue later
    assert not summary.ok
    failed = {d.headers[h.MESSAGE_ID]: d.headers for d in replaying.drain(
        replaying.world.error_queue)}
    assert set(failed) == {f"{unique}-not-json", f"{unique}-unknown", f"{unique}-bad-headers"}
    assert "not valid JSON" in failed[f"{unique}-not-json"][h.EXCEPTION_MESSAGE]
    assert "headers column" in failed[f"{unique}-bad-headers"][h.EXCEPTION_MESSAGE]
    assert all(headers[h.FAILED_QUEUE] == replaying.world.name for headers in failed.values())
    [event] = replaying.drain()
    assert event.headers[h.CORRELATION_ID] == "order-77"
    assert replaying.trails() == {"agg-0": [0]}


def test_a_map_of_headers_and_a_struct_body_are_read_as_json_objects(make_world, unique):
    # Spark hands the rows over as Arrow columns: a map and a struct arrive as objects.
    replaying = make_world()
    message = Message(f"{unique}-typed", "agg-3", 0)
    rows = [(message.message_id, "spark.Step", {"aggregate": "agg-3", "sequence": 0},
             {h.CORRELATION_ID: "order-78"}, "agg-3", 0)]
    frame = replaying.spark.createDataFrame(
        rows, "message_id string, message_type string, "
              "body struct<aggregate: string, sequence: long>, "
              "headers map<string, string>, aggregate_id string, sequence long")

    summary = replay(frame, replaying.reference)

    assert (summary.replayed, summary.handled, summary.ok) == (1, 1, True)
    [event] = replaying.drain()
    assert event.headers[h.CORRELATION_ID] == "order-78"
    assert replaying.trails() == {"agg-3": [0]}


def test_an_endpoint_on_process_local_storage_is_refused(spark):
    frame = spark.createDataFrame([], SCHEMA)

    with pytest.raises(ConfigurationError, match="process-local .*PostgresStorage"):
        replay(frame, "tests.spark_endpoints:process_local_endpoint")


def test_a_missing_column_is_named(make_world):
    replaying = make_world()
    frame = replaying.spark.createDataFrame([], "message_id string, message_type string, "
                                                "body string, aggregate_id string")

    with pytest.raises(ConfigurationError, match="no column 'sequence' .*--order-by"):
        replay(frame, replaying.reference)


def test_the_command_replays_json_lines_and_leaves_the_running_session_alone(
        make_world, spark, tmp_path, unique, capsys):
    replaying = make_world()
    messages = make_messages(unique, aggregates=2, steps=5)
    source = tmp_path / "archive"
    source.mkdir()
    with open(source / "messages.json", "w") as lines:
        for message in messages:  # the body as a JSON object this time
            lines.write(json.dumps({
                "message_id": message.message_id, "message_type": "spark.Step",
                "body": json.loads(message.body), "headers": {"origin": "archive"},
                "aggregate_id": message.aggregate, "sequence": message.sequence}) + "\n")

    status = main(["spark", "replay", replaying.reference, str(source),
                   "--master", spark.sparkContext.master, "--partitions", "2"])

    assert status == 0
    assert capsys.readouterr().out.startswith("replayed=10 handled=10 duplicates=0 ")
    assert replaying.trails() == expected_trails(aggregates=2, steps=5)
    assert spark.range(3).count() == 3  # the shared session still runs


def test_an_archive_of_version_1_messages_replays_into_version_2_handlers_once_each(
        make_world, spark, tmp_path, unique, capsys):
    # Given an archive written when Moved was version 1 (kilometres): most rows from before
    # versions existed (no version header), some saying version 1, one already version 2
    replaying = make_world(handlers="odometer")
    source = tmp_path / "archive"
    source.mkdir()
    expected: dict[str, list[int]] = defaultdict(list)
    with open(source / "moves.json", "w") as lines:
        for aggregate in ("a", "b", "c"):
            for sequence in range(4):
                headers: dict[str, str] = {}
                body: dict[str, Any] = {"aggregate": aggregate, "sequence": sequence,
                                        "km": sequence + 0.5}
                if sequence == 1:
                    headers[h.MESSAGE_VERSION] = "1"
                if (aggregate, sequence) == ("c", 3):
                    headers[h.MESSAGE_VERSION] = "2"
                    body = {"aggregate": aggregate, "sequence": sequence, "metres": 3500}
                expected[aggregate].append(sequence * 1000 + 500)
                lines.write(json.dumps({
                    "message_id": f"{unique}-{aggregate}-{sequence}",
                    "message_type": "spark.Moved", "body": body, "headers": headers,
                    "aggregate_id": aggregate, "sequence": sequence}) + "\n")

    # When it is replayed through the command, twice
    for _ in range(2):
        assert main(["spark", "replay", replaying.reference, str(source),
                     "--master", spark.sparkContext.master, "--partitions", "2"]) == 0

    # Then every message was applied once, in order, in its version-2 shape
    first, second = capsys.readouterr().out.splitlines()[-2:]
    assert first.startswith("replayed=12 handled=12 duplicates=0 ")
    assert second.startswith("replayed=12 handled=0 duplicates=12 ")
    storage = replaying.world.storage()
    try:
        applied = {r.aggregate_id: r.state["metres"] for r in storage.records("Odometer")}
    finally:
        storage.close()
    assert applied == expected
    assert replaying.drain(replaying.world.error_queue) == []


def test_an_error_queue_export_replays_through_the_endpoint_once(
        make_world, spark, tmp_path, unique, capsys):
    # Given a failed Step in the endpoint's error queue, with its story in the headers
    replaying = make_world()
    world = replaying.world
    failed = Message(f"{unique}-failed", "agg-9", 0)
    transport = world.transport()
    transport.declare(world.error_queue)
    transport.send(Envelope(
        {h.MESSAGE_ID: failed.message_id, h.MESSAGE_TYPE: "spark.Step",
         h.EXCEPTION_TYPE: "builtins.ConnectionError", h.FAILED_QUEUE: world.name,
         h.TIME_OF_FAILURE: "2031-05-04T12:00:00+00:00", h.IMMEDIATE_ATTEMPTS: "6"},
        failed.body, world.error_queue))
    transport.close()

    # When it is exported and the export replayed
    export = tmp_path / "failed.json"
    assert main(["errors", "export", replaying.reference, str(export)]) == 0
    assert main(["spark", "replay", replaying.reference, str(export), "--partition-by", "none",
                 "--order-by", "time_of_failure", "--master", spark.sparkContext.master]) == 0

    # Then it is applied once, and its failure story did not travel with it
    assert "replayed=1 handled=1" in capsys.readouterr().out
    assert replaying.trails() == {"agg-9": [0]}
    (row,) = [json.loads(line) for line in export.read_text().splitlines()]
    assert row["message_id"] == failed.message_id and row["failed_queue"] == world.name
    assert h.EXCEPTION_TYPE not in json.loads(row["headers"])
