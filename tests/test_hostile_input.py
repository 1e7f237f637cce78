"""A hostile client publishes whatever it likes to a running endpoint on RabbitMQ and
PostgreSQL (``idembus run`` in its own process), with a plain AMQP client.

Invariants, whatever arrives: every message is applied exactly once or is in the error
queue (or parked) with a reason of the kind the model expects, its body forwarded
unchanged and the headers it lost named; a message the client library or the broker
refuses at publish is one the model says is refused there, and no other; the endpoint
keeps processing; its resident memory, sampled while the traffic flows, stays under an
absolute bound and grows by a few copies of the largest body at most. Reduced size in
``make test`` (``IDEMBUS_HOSTILE_EXAMPLES`` raises it).
"""

from __future__ import annotations

import bz2
import json
import os
import pathlib
import secrets
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.pg_procs import resident_kib
from idembus import headers as h
from idembus.storage.postgres import PostgresStorage
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport
from idembus.wire import DEFAULT_MAX_MESSAGE_BYTES
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.hostile import (
    LIVE_ENDPOINT,
    SEQUENCE,
    Model,
    WireMessage,
    assert_handled,
    plain_amqp,
    publish,
    publish_refusal,
    wire_messages,
)
from tests.test_workers import LineWatcher, wait_until

pytestmark = [pytest.mark.amqp, pytest.mark.postgres,
              # A failing example's repr is large (the model): report it, do not fail on it
              pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")]
ROOT = pathlib.Path(__file__).resolve().parent.parent
#: The endpoint's resident memory may never exceed this while hostile traffic flows: it
#: stays near 60 MiB under the generated traffic (bodies of a few KiB) and below 80 MiB
#: under the bomb and the 8 MiB bodies (RabbitMQ 3.10, PostgreSQL 16, Python 3.11).
RSS_LIMIT_MIB = 160
#: How often the endpoint's resident memory is sampled.
RSS_INTERVAL = 0.05

APP = textwrap.dedent('''
    import os

    from idembus import Endpoint, Recoverability, RetryPolicy
    from idembus.storage.postgres import PostgresStorage
    from tests.hostile import Pinger
    from tests.support import AccountHandler


    def make() -> Endpoint:
        return Endpoint(
            os.environ["APP_QUEUE"],
            transport=os.environ["APP_TRANSPORT"],
            storage=PostgresStorage(os.environ["APP_POSTGRES"],
                                    table_prefix=os.environ["APP_PREFIX"]),
            handlers=[AccountHandler, Pinger],
            error_queue=os.environ["APP_ERROR_QUEUE"],
            recoverability=Recoverability(retries=RetryPolicy(immediate_retries=1, delayed=())),
            prefetch=8,
        )
''')


class MemorySampler:
    """Samples a process's resident memory (``VmRSS``) in a thread, keeping the highest
    value since the last :meth:`take_peak`."""

    def __init__(self, pid: int, interval: float = RSS_INTERVAL) -> None:
        self._pid = pid
        self._interval = interval
        self._peak = 0
        self._samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                kib = resident_kib(self._pid)
            except (OSError, LookupError):  # the process has ended
                return
            with self._lock:
                self._peak = max(self._peak, kib)
                self._samples += 1
            self._stop.wait(self._interval)

    def take_peak(self) -> tuple[int, int]:
        """The highest sample (KiB) since the last call, one taken now included, and how
        many samples that is."""
        now = resident_kib(self._pid)
        with self._lock:
            found = (max(self._peak, now), self._samples + 1)
            self._peak, self._samples = 0, 0
        return found

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@dataclass
class HostileTarget:
    """A running endpoint and what the hostile client has sent it so far."""

    queue: str
    error_queue: str
    prefix: str
    process: subprocess.Popen[str]
    err: LineWatcher
    transport: KombuTransport
    memory: MemorySampler
    model: Model = field(default_factory=Model)
    sequence: int = 0
    sentinels: int = 0
    #: How many messages were refused at publish, by the model's reason (for a failure's
    #: report).
    refused_at_publish: dict[str, int] = field(default_factory=dict)

    def accounts(self) -> dict[str, dict[str, Any]]:
        with psycopg.connect(POSTGRES_URL) as connection:
            rows = connection.execute(
                f"SELECT aggregate_id, state FROM {self.prefix}_aggregates").fetchall()
        return {row[0]: row[1] for row in rows}

    def send(self, messages: list[WireMessage]) -> dict[int, WireMessage]:
        """Publish ``messages`` and a good sentinel deposit after them; return when the
        endpoint has handled the sentinel (it consumes in order), by sequence number. A
        message the client library or the broker refuses at publish never reached the
        endpoint: it must be one :func:`publish_refusal` expects to be refused, with the
        error expected, and it is left out."""
        sent: dict[int, WireMessage] = {}
        for message in messages:
            self.sequence += 1
            message.sequence = self.sequence
            expected = publish_refusal(message)
            try:
                with plain_amqp(AMQP_URL) as channel:
                    publish(channel, self.queue, message)
            except Exception as exc:
                assert expected is not None, f"publishing {message!r} failed: {exc!r}"
                assert isinstance(exc, expected.raises), (expected, repr(exc))
                self.refused_at_publish[expected.reason] = (
                    self.refused_at_publish.get(expected.reason, 0) + 1)
                continue
            assert expected is None, f"{message!r} was published: not {expected.reason}"
            self.model.expect(message)
            sent[message.sequence] = message
        self.sequence += 1
        sentinel = WireMessage(
            headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"},
            body=json.dumps({"account": "sentinel", "amount": 1}).encode(),
            sequence=self.sequence)
        with plain_amqp(AMQP_URL) as channel:
            publish(channel, self.queue, sentinel)
        assert self.model.expect(sentinel) == "applied"
        self.sentinels += 1
        assert wait_until(lambda: self.accounts().get("sentinel", {}).get("deposits")
                          == self.sentinels, timeout=60), (
            "the endpoint stopped processing: " + "\n".join(self.err.lines[-20:]))
        assert self.process.poll() is None
        return sent

    def take_error_queue(self) -> dict[int, Delivery]:
        """Every copy now in the error queue (removed), by sequence number; read as the
        endpoint's transport reads (a plain py-amqp client cannot read a content type
        that is not UTF-8, which a copy carries on as it came)."""
        copies: dict[int, Delivery] = {}
        while (copy := self.transport.get(self.error_queue)) is not None:
            sequence = int(copy.headers[SEQUENCE])
            assert sequence not in copies, f"message {sequence} dead-lettered twice"
            copies[sequence] = copy
        return copies

    def peak_memory_kib(self) -> int:
        """The endpoint process's peak resident memory (VmHWM)."""
        return resident_kib(self.process.pid, "VmHWM")

    def assert_memory_bounded(self) -> None:
        """The highest resident memory sampled since the last look is under the limit."""
        peak_kib, samples = self.memory.take_peak()
        assert peak_kib / 1024 < RSS_LIMIT_MIB, (
            f"the endpoint's resident memory reached {peak_kib / 1024:.0f} MiB "
            f"(highest of {samples} samples)")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileTarget]:
    require_service(AMQP_URL, "RabbitMQ")
    require_service(POSTGRES_URL, "PostgreSQL")
    directory = tmp_path_factory.mktemp("hostile")
    (directory / "hostile_app.py").write_text(APP)
    suffix = uuid.uuid4().hex[:10]
    queue, error_queue, prefix = f"hostile-{suffix}", f"hostile-error-{suffix}", f"ho{suffix}"
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.migrate()
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "APP_QUEUE": queue,
                   "APP_ERROR_QUEUE": error_queue, "APP_PREFIX": prefix,
                   "APP_TRANSPORT": AMQP_URL, "APP_POSTGRES": POSTGRES_URL}
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", "run", "hostile_app:make", "--log-level", "INFO"],
        cwd=directory, env=environment, text=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    assert process.stderr is not None
    err = LineWatcher(process.stderr)
    transport = KombuTransport(AMQP_URL)
    assert wait_until(lambda: transport.pending(error_queue) == 0 and _declared(transport, queue)
                      , timeout=60), "the endpoint did not start: " + "\n".join(err.lines)
    memory = MemorySampler(process.pid)
    target = HostileTarget(queue, error_queue, prefix, process, err, transport, memory)
    try:
        yield target
    finally:
        memory.stop()
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        err.join()
        for name in (queue, error_queue):
            transport.delete_queue(name)
        transport.close()
        storage.drop_tables()
        storage.close()


def _declared(transport: KombuTransport, queue: str) -> bool:
    """True once the endpoint has declared its queue and its consumer holds it."""
    with plain_amqp(AMQP_URL) as channel:
        try:
            _, _, consumers = channel.queue_declare(queue, passive=True)
        except Exception:
            return False
    return consumers > 0


def check(target: HostileTarget, sent: dict[int, WireMessage]) -> None:
    """The invariants, after the endpoint has handled everything ``sent``."""
    assert_handled(target.model, target.take_error_queue(), sent, target.accounts())
    target.assert_memory_bounded()


@LIVE_ENDPOINT
@given(messages=st.lists(wire_messages(), min_size=1, max_size=8))
def test_whatever_a_hostile_client_publishes_is_applied_once_or_dead_lettered_with_a_reason(
    target: HostileTarget, messages: list[WireMessage],
) -> None:
    sent = target.send(messages)
    check(target, sent)


def test_a_compression_bomb_and_oversized_bodies_cost_bounded_memory(
    target: HostileTarget,
) -> None:
    # Given the endpoint's memory after the generated traffic
    before = target.peak_memory_kib()
    target.memory.take_peak()
    large = 8 * 1024 * 1024
    bomb = bz2.compress(b"\0" * (256 * 1024 * 1024))  # a few hundred bytes, 256 MiB inside

    # When a compression bomb, a body just over the limit and a large one arrive
    good = {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"}
    messages = [
        WireMessage(headers={**good, "compression": "application/x-bz2"}, body=bomb),
        WireMessage(headers={**good, h.MESSAGE_ID: str(uuid.uuid4())},
                    body=json.dumps({"account": "a", "amount": 1,
                                     "pad": "x" * DEFAULT_MAX_MESSAGE_BYTES}).encode()),
        WireMessage(headers={**good, h.MESSAGE_ID: str(uuid.uuid4())}, body=b"y" * large),
    ]
    sent = target.send(messages)

    # Then each is in the error queue with its reason and unchanged bytes (the bomb still
    # compressed), and the endpoint's peak memory grew by a few copies of the largest body
    # at most, never by the bomb's content
    check(target, sent)
    grown_mib = (target.peak_memory_kib() - before) / 1024
    assert grown_mib < 6 * large / 2**20 + 32, f"peak memory grew by {grown_mib:.0f} MiB"


def test_the_permanent_failure_matrix_parks_or_dead_letters_each_and_the_endpoint_goes_on(
    target: HostileTarget,
) -> None:
    # Given messages that fail for good in each way the broker or the database refuses
    def numbered(message: WireMessage) -> WireMessage:
        target.sequence += 1
        message.sequence = target.sequence
        return message

    def ping(reply_to: str) -> WireMessage:
        return numbered(WireMessage(
            headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Ping",
                     h.REPLY_TO: reply_to}, body=json.dumps({"note": reply_to[:20]}).encode()))

    def deposit(account: str) -> WireMessage:
        return numbered(WireMessage(
            headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"},
            body=json.dumps({"account": account, "amount": 1}).encode()))

    reserved_reply = ping("amq.gen-nobody-declared-this")
    long_reply = ping("r" * 300)
    nul_account = deposit("nul\x00inside")
    long_account = deposit(secrets.token_hex(3200))  # 6,400 bytes that do not compress
    stuffed = numbered(WireMessage(
        headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "nobody.KnowsThis",
                 "padding": "x" * 130_000}, body=b"{}"))

    # When a client publishes them, and then the good messages of target.send
    with plain_amqp(AMQP_URL) as channel:
        for message in (reserved_reply, long_reply, nul_account, long_account, stuffed):
            publish(channel, target.queue, message)
    target.send([])  # a good deposit after them is applied: the endpoint went on

    # Then the pings are handled and their refused replies parked with the broker's reason,
    # and the stuffed message is parked (a requeued message may come back after the
    # sentinel: quorum queues of RabbitMQ 3 requeue at the back)
    expected = {reserved_reply.headers[h.MESSAGE_ID], long_reply.headers[h.MESSAGE_ID],
                stuffed.headers[h.MESSAGE_ID]}
    storage = PostgresStorage(POSTGRES_URL, table_prefix=target.prefix)
    try:
        def parked_now() -> dict[str, Any]:
            return {p.envelope.headers.get(h.CAUSATION_ID) or p.envelope.message_id: p
                    for p in storage.parked_messages(target.queue)}
        assert wait_until(lambda: set(parked_now()) >= expected, timeout=60), (
            "\n".join(target.err.lines[-60:]))
        parked = {p.envelope.message_id: p for p in storage.parked_messages(target.queue)}
    finally:
        storage.close()
    replies = {p.envelope.destination: p for p in parked.values()
               if p.envelope.message_type == "test.Pong"}
    assert set(replies) == {"amq.gen-nobody-declared-this", "r" * 300}
    assert "255" in replies["r" * 300].envelope.headers[h.EXCEPTION_MESSAGE]
    # And the stuffed one, whose error-queue copy cannot fit a frame, is parked too
    assert parked[stuffed.headers[h.MESSAGE_ID]].source == "error-queue"
    # And the deposits the database refuses are in the error queue with its reason
    copies = target.take_error_queue()
    assert set(copies) == {nul_account.sequence, long_account.sequence}
    reasons = {s: copies[s].headers[h.EXCEPTION_MESSAGE] for s in copies}
    assert "StorageRefused" in copies[nul_account.sequence].headers[h.EXCEPTION_TYPE]
    assert "54000" in reasons[long_account.sequence]
