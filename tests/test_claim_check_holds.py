"""Claim-checked bodies outlive every copy that still refers to them: an error-queue copy
holds its body until it is retried (then the body is kept a retention from the retry) or
purged, and a delayed retry due after the body's time moves that time on.

Requirement: a body whose message is in the error queue survives collection long past its
retention; once the copy is retried and handled, or purged, the body is collected by the
usual rule. Run on memory://, RabbitMQ and Redis with the bodies in memory, mongomock and
PostgreSQL.
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator

import pytest

from idembus import ClaimCheck, Endpoint, KombuTransport, Recoverability
from idembus import headers as h
from idembus.envelope import utc_now
from idembus.handlers import Handler, handles
from idembus.policies import RetryPolicy
from idembus.storage.base import PayloadStore
from idembus.storage.claims import payload_id
from idembus.testing import wait_until_idle
from tests.payload_stores import payload_store
from tests.support import SignalCounter
from tests.test_claim_check import Blobs, Refusing, StoreBlob, blob
from tests.test_cli_errors import (
    NO_RETRIES,
    SharedMemoryStorage,
    idembus,
    shared_in_this_process,
)
from tests.test_parking import RefusesTheErrorQueue

MakeEndpoint = Callable[..., Endpoint]
RETENTION = datetime.timedelta(hours=1)


@pytest.fixture(params=["memory", "mongomock",
                        pytest.param("postgres", marks=pytest.mark.postgres)])
def payloads(request: pytest.FixtureRequest, unique: str) -> Iterator[PayloadStore]:
    """The payload store every endpoint of a test shares."""
    with payload_store(request.param, f"holds-{unique}", f"h{unique}") as store:
        yield store


def later(delta: datetime.timedelta) -> datetime.datetime:
    return utc_now() + delta


def tool(make_transport: Callable[..., KombuTransport], monkeypatch: pytest.MonkeyPatch,
         receiver: Endpoint, payloads: PayloadStore) -> str:
    """A module the ``idembus errors`` commands load the receiver from: its reference."""
    module = types.ModuleType(f"claims_holds_{uuid.uuid4().hex[:8]}")
    tool_storage = SharedMemoryStorage()  # the tool's database: one for every run
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        receiver.name, transport=shared_in_this_process(make_transport()),
        storage=tool_storage, error_queue=receiver.error_queue,
        claim_check=ClaimCheck(store=payloads, retention=RETENTION))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return f"{module.__name__}:endpoint"


def failed_claim_checked(make_endpoint: MakeEndpoint, payloads: PayloadStore) -> tuple[
        Endpoint, str]:
    """A claim-checked message whose handler failed for good: the receiver, message id."""
    receiver = make_endpoint("blobs", handlers=[Refusing()], claim_check=ClaimCheck(
        store=payloads, retention=RETENTION), recoverability=Recoverability(
        retries=NO_RETRIES))
    dead = SignalCounter(receiver, "dead_lettered")
    sender = make_endpoint("uploads", claim_check=ClaimCheck(
        threshold_bytes=1000, store=payloads, retention=RETENTION))
    with receiver, sender:
        message_id = sender.bus.send(StoreBlob(name="held", data=blob("held", 50_000)),
                                     to=receiver.name)
        assert dead.wait_for(1)
    return receiver, message_id


def test_a_body_in_the_error_queue_is_held_until_its_copy_is_retried_and_handled(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    payloads: PayloadStore,
) -> None:
    # Given a claim-checked message in the error queue
    receiver, message_id = failed_claim_checked(make_endpoint, payloads)
    reference = tool(make_transport, monkeypatch, receiver, payloads)
    body = payloads.get_payload(payload_id(message_id))
    assert body is not None

    # When collection runs long after the body's retention
    assert payloads.collect_payloads(later(datetime.timedelta(days=400))) == 0

    # Then the body is still there, and the copy shows it (with the hold that keeps it)
    status, out, _ = idembus(capsys, "show", reference, message_id, "--json")
    assert status == 0
    [shown] = json.loads(out)
    assert shown["claim_check"]["found"] is True
    assert shown["claim_check"]["bytes"] == len(body)
    assert h.CLAIM_CHECK_HOLD in shown["headers"]

    # When the copy is retried, without the hold, and handled this time
    status, out, _ = idembus(capsys, "retry", reference, message_id)
    assert status == 0, out
    blobs = Blobs()
    handled = make_endpoint("blobs", handlers=[blobs], claim_check=ClaimCheck(
        store=payloads, retention=RETENTION))
    with handled:
        wait_until_idle([handled])
    assert blobs.received == [("held", 50_000, True)]

    # Then the body is kept a retention from the retry, then collected
    assert payloads.collect_payloads(later(RETENTION / 2)) == 0
    assert payloads.get_payload(payload_id(message_id)) == body
    assert payloads.collect_payloads(later(RETENTION * 2)) == 1
    assert payloads.get_payload(payload_id(message_id)) is None


def test_a_purged_copy_releases_its_body_to_the_usual_collection(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    payloads: PayloadStore,
) -> None:
    # Given a claim-checked message in the error queue, held past its retention
    receiver, message_id = failed_claim_checked(make_endpoint, payloads)
    reference = tool(make_transport, monkeypatch, receiver, payloads)
    assert payloads.collect_payloads(later(RETENTION * 2)) == 0

    # When the copy is purged
    status, _, _ = idembus(capsys, "purge", reference, message_id, "--yes")
    assert status == 0

    # Then the body's own time (long past) applies again: collected
    assert payloads.collect_payloads(later(RETENTION * 2)) == 1
    assert payloads.get_payload(payload_id(message_id)) is None


class FailsOnce(Handler):
    """Fails the first delivery of each blob, handles the next."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.handled = threading.Event()

    @handles
    def store(self, message: StoreBlob) -> None:
        if message.name not in self.seen:
            self.seen.add(message.name)
            raise ValueError("not yet")
        self.handled.set()


@pytest.mark.timeout(60)
def test_a_delayed_retry_due_after_the_bodys_time_keeps_the_body_until_then(
    make_endpoint: MakeEndpoint, payloads: PayloadStore,
) -> None:
    # Given bodies kept one second, and a receiver whose delayed retry waits two
    retention = datetime.timedelta(seconds=1)
    handler = FailsOnce()
    receiver = make_endpoint("blobs", handlers=[handler], claim_check=ClaimCheck(
        store=payloads, retention=retention), recoverability=Recoverability(
        retries=RetryPolicy(immediate_retries=0, delayed=(2.0,))))
    retried = SignalCounter(receiver, "retried")
    sender = make_endpoint("uploads", claim_check=ClaimCheck(
        threshold_bytes=1000, store=payloads, retention=retention))
    with receiver, sender:
        message_id = sender.bus.send(StoreBlob(name="later", data=blob("later", 20_000)),
                                     to=receiver.name)
        # When the first attempt failed and a collection runs after the body's own time
        # but before the retry is due
        assert retried.wait_for(1)
        assert payloads.collect_payloads(later(datetime.timedelta(seconds=1.5))) == 0
        # Then the retry finds its body and is handled
        assert handler.handled.wait(30)
        wait_until_idle([receiver, sender])
    assert receiver.counters["dead_lettered"] == 0
    assert payloads.get_payload(payload_id(message_id)) is not None
    assert payloads.collect_payloads(later(datetime.timedelta(seconds=10))) == 1


def test_a_parked_copy_holds_its_body_until_it_is_retried(
    unique: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    payloads: PayloadStore,
) -> None:
    # Given a receiver whose broker refuses every copy for its error queue, so that a
    # claim-checked message whose handler fails is parked in its storage
    error_queue = f"error-{unique}"
    storage = SharedMemoryStorage()
    receiver = Endpoint(f"blobs-{unique}", transport=RefusesTheErrorQueue(error_queue),
                        storage=storage, error_queue=error_queue, handlers=[Refusing()],
                        claim_check=ClaimCheck(store=payloads, retention=RETENTION),
                        recoverability=Recoverability(retries=NO_RETRIES))
    sender = Endpoint(f"uploads-{unique}", transport=KombuTransport("memory://"),
                      claim_check=ClaimCheck(threshold_bytes=1000, store=payloads,
                                             retention=RETENTION))
    dead = SignalCounter(receiver, "dead_lettered")
    module = types.ModuleType(f"claims_parked_{uuid.uuid4().hex[:8]}")
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        receiver.name, transport=shared_in_this_process(KombuTransport("memory://")),
        storage=storage, error_queue=error_queue,
        claim_check=ClaimCheck(store=payloads, retention=RETENTION))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        with receiver, sender:
            message_id = sender.bus.send(StoreBlob(name="parked", data=blob("parked", 30_000)),
                                         to=receiver.name)
            assert dead.wait_for(1)
        [parked] = storage.parked_messages(receiver.name)
        assert h.CLAIM_CHECK_HOLD in parked.envelope.headers

        # When collection runs long after the body's retention, the body stays
        assert payloads.collect_payloads(later(datetime.timedelta(days=400))) == 0

        # When the parked message is retried
        status, out, _ = idembus(capsys, "retry", f"{module.__name__}:endpoint", message_id)
        assert status == 0, out

        # Then it goes back without the hold, and the body is kept a retention from now
        retried = receiver.transport.get(receiver.name)
        assert retried is not None and h.CLAIM_CHECK_HOLD not in retried.headers
        assert payloads.collect_payloads(later(RETENTION / 2)) == 0
        assert payloads.collect_payloads(later(RETENTION * 2)) == 1
    finally:
        receiver.close()
        sender.close()
