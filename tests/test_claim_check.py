"""The claim check (:mod:`idembus.storage.claims`): bodies over a threshold travel as a
reference to a payload store and are read back before decoding.

Requirement: a large body sent by a handler or from outside handlers reaches its handler
whole while the wire carries only a reference; a crash between commit and publish (even
one after the body was written, and the body collected meanwhile) ends with the same
reference sent again and the message handled once; a reference that cannot be resolved
goes to the error queue with the reason and keeps the reference; per-type thresholds
apply. Run on memory://, RabbitMQ and Redis (``make_endpoint``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib
import sys
import threading
import types
import uuid
from collections.abc import Callable

import pytest

from idembus import (
    Backoff,
    ClaimCheck,
    Command,
    ConfigurationError,
    Endpoint,
    KombuTransport,
    MemoryStorage,
    Recoverability,
)
from idembus import headers as h
from idembus.envelope import Envelope, utc_now
from idembus.handlers import Handler, handles
from idembus.pipeline import Dispatch, IncomingMessage, Middleware
from idembus.storage.base import PayloadStore
from idembus.storage.claims import payload_id
from idembus.storage.errors import StorageUnavailable
from idembus.testing import wait_until_idle
from idembus.testing.faults import SimulatedCrash
from tests.support import SignalCounter
from tests.test_cli_errors import (
    NO_RETRIES,
    SharedMemoryStorage,
    idembus,
    shared_in_this_process,
)

MakeEndpoint = Callable[..., Endpoint]
THRESHOLD = 64 * 1024


class Upload(Command, message_name="claims.Upload"):
    name: str
    size: int


class StoreBlob(Command, message_name="claims.StoreBlob"):
    name: str
    data: str


def blob(name: str, size: int) -> str:
    """A body that differs from byte to byte, so a wrong or cut one is seen."""
    seed = hashlib.sha256(name.encode()).hexdigest()
    return (seed * (size // len(seed) + 1))[:size]


class Uploads(Handler):
    sends = (StoreBlob,)

    @handles
    def upload(self, message: Upload) -> None:
        self.bus.send(StoreBlob(name=message.name, data=blob(message.name, message.size)))


class Blobs(Handler):
    def __init__(self) -> None:
        self.received: list[tuple[str, int, bool]] = []
        self._lock = threading.Lock()

    @handles
    def store(self, message: StoreBlob) -> None:
        size = len(message.data)
        with self._lock:
            self.received.append((message.name, size, message.data == blob(message.name, size)))


class WireHeaders(Middleware):
    """Keeps the headers of every delivery as it came off the wire."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def before_message(self, incoming: IncomingMessage) -> None:
        self.seen.append(dict(incoming.headers))


class Watched(PayloadStore):
    """A payload store that counts writes and can "die" once right after one."""

    def __init__(self, store: PayloadStore, *, crash_after_first_write: bool = False,
                 collect_before_crash: bool = False) -> None:
        self.store = store
        self.writes: list[str] = []
        self.crash = crash_after_first_write
        self.collect = collect_before_crash

    def put_payload(self, payload_id: str, body: bytes, *,
                    keep_until: datetime.datetime) -> None:
        self.store.put_payload(payload_id, body, keep_until=keep_until)
        self.writes.append(payload_id)
        if self.crash:
            self.crash = False
            if self.collect:  # a collection long after: the body is gone before the publish
                far = utc_now() + datetime.timedelta(days=3650)
                assert self.store.collect_payloads(far) == 1
            raise SimulatedCrash("killed between the body's write and the publish")

    def get_payload(self, payload_id: str) -> bytes | None:
        return self.store.get_payload(payload_id)

    def collect_payloads(self, now: datetime.datetime, *, batch: int = 100) -> int:
        return self.store.collect_payloads(now, batch=batch)

    def hold_payload(self, payload_id: str, hold_id: str) -> bool:
        return self.store.hold_payload(payload_id, hold_id)

    def release_payload(self, hold_id: str, *, keep_until: datetime.datetime) -> bool:
        return self.store.release_payload(hold_id, keep_until=keep_until)


def pair(make_endpoint: MakeEndpoint, store: PayloadStore, **sender: object,
         ) -> tuple[Endpoint, Endpoint, Blobs, WireHeaders]:
    blobs, wire = Blobs(), WireHeaders()
    receiver = make_endpoint("blobs", handlers=[blobs], middleware=[wire],
                             claim_check=ClaimCheck(store=store))
    options: dict[str, object] = {"claim_check": ClaimCheck(threshold_bytes=THRESHOLD,
                                                            store=store), **sender}
    uploads = make_endpoint("uploads", handlers=[Uploads],
                            routes={StoreBlob: receiver.name}, **options)
    return uploads, receiver, blobs, wire


def test_large_bodies_travel_as_references_and_reach_their_handlers_whole(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a sender that claim-checks bodies over 64 KiB into a store the receiver reads
    payloads = MemoryStorage()
    uploads, receiver, blobs, wire = pair(make_endpoint, payloads)
    with uploads, receiver:
        # When a handler sends a large and a small body, and a large one is sent from
        # outside handlers
        uploads.bus.send(Upload(name="large", size=3 * 1024 * 1024))
        uploads.bus.send(Upload(name="small", size=100))
        direct_id = uploads.bus.send(StoreBlob(name="direct", data=blob("direct", 200_000)),
                                     to=receiver.name)
        wait_until_idle([uploads, receiver])

    # Then every body reached its handler whole, once
    assert sorted(blobs.received) == [("direct", 200_000, True),
                                      ("large", 3 * 1024 * 1024, True), ("small", 100, True)]
    # And only the large ones travelled as references, named after their message ids
    by_name = {headers[h.MESSAGE_ID]: headers for headers in wire.seen}
    claimed = {message_id: headers for message_id, headers in by_name.items()
               if h.CLAIM_CHECK in headers}
    assert len(claimed) == 2 and direct_id in claimed
    for message_id, headers in claimed.items():
        assert headers[h.CLAIM_CHECK] == payload_id(message_id)
        assert payloads.get_payload(payload_id(message_id)) is not None
    stored = payloads.get_payload(payload_id(direct_id))
    assert stored is not None and claimed[direct_id][h.CLAIM_CHECK_BYTES] == str(len(stored))
    assert StoreBlob.model_validate_json(stored).data == blob("direct", 200_000)
    assert receiver.counters["dead_lettered"] == 0


@pytest.mark.parametrize("collected", [False, True], ids=["kept", "collected-meanwhile"])
def test_a_crash_between_the_bodys_write_and_the_publish_sends_the_same_reference_again(
    make_endpoint: MakeEndpoint, collected: bool,
) -> None:
    # Given a sender whose process dies right after writing a claim-checked body, before
    # publishing its reference (and, in one case, a collection far in the future runs in
    # between and removes the body)
    payloads = MemoryStorage()
    watched = Watched(payloads, crash_after_first_write=True, collect_before_crash=collected)
    uploads, receiver, blobs, wire = pair(make_endpoint, watched)
    with uploads, receiver:
        # When a handler's large message is committed and the delivery comes back
        uploads.bus.send(Upload(name="crashy", size=1024 * 1024))
        wait_until_idle([uploads, receiver])

    # Then the message was handled once, whole, from the same reference written again
    assert blobs.received == [("crashy", 1024 * 1024, True)]
    [headers] = wire.seen
    assert watched.writes == [headers[h.CLAIM_CHECK]] * 2
    assert uploads.counters["duplicate"] == 1  # the redelivery found the commit
    assert payloads.get_payload(headers[h.CLAIM_CHECK]) is not None


def test_collection_never_takes_a_body_an_undispatched_message_needs(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a committed message whose publish has not happened yet (its dispatch "dies")
    payloads = MemoryStorage()
    uploads, receiver, blobs, _ = pair(make_endpoint, payloads,
                                       middleware=[DieAtFirstDispatch(payloads)])
    with uploads, receiver:
        uploads.bus.send(Upload(name="later", size=500_000))
        wait_until_idle([uploads, receiver])
    # Then the collection that ran while it was undispatched found nothing to take (the
    # committed entry holds the body) and the message arrived whole afterwards
    assert blobs.received == [("later", 500_000, True)]


class DieAtFirstDispatch(Middleware):
    """Collects every body (as if long past retention) and dies when the first claim-checked
    message is about to be dispatched: after its commit, before its body is written."""

    def __init__(self, store: MemoryStorage) -> None:
        self.store = store
        self.died = False

    def before_dispatch(self, dispatch: Dispatch) -> None:
        if not self.died and dispatch.envelope.message_type == "claims.StoreBlob":
            self.died = True
            far = utc_now() + datetime.timedelta(days=3650)
            assert self.store.collect_payloads(far) == 0  # nothing anyone refers to yet
            raise SimulatedCrash("killed after the commit, before the dispatch")


def test_a_reference_that_cannot_be_resolved_goes_to_the_error_queue_with_it(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a receiver reading a store that lacks the body a message refers to
    blobs = Blobs()
    receiver = make_endpoint("blobs", handlers=[blobs],
                             claim_check=ClaimCheck(store=MemoryStorage()))
    dead = SignalCounter(receiver, "dead_lettered")
    message_id = str(uuid.uuid4())
    reference = payload_id(message_id)
    with receiver:
        # When such a message arrives
        receiver.transport.send(Envelope(
            headers={h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "claims.StoreBlob",
                     h.CLAIM_CHECK: reference, h.CLAIM_CHECK_BYTES: "123"},
            body=f'{{"{h.CLAIM_CHECK}": "{reference}", "bytes": 123}}',
            destination=receiver.name))
        assert dead.wait_for(1)
        wait_until_idle([receiver])
        copy = receiver.transport.get(receiver.error_queue)
    # Then it went to the error queue unhandled, with the reason and its reference kept
    assert blobs.received == []
    assert copy is not None
    assert copy.headers[h.EXCEPTION_TYPE] == "idembus.errors.MalformedMessage"
    assert "not in the payload store" in copy.headers[h.EXCEPTION_MESSAGE]
    assert copy.headers[h.CLAIM_CHECK] == reference
    assert receiver.counters["failed"] == 0  # bad input: not retried


def test_a_type_may_have_its_own_threshold() -> None:
    check = ClaimCheck(threshold_bytes=10**9, types={StoreBlob: 0, "other.Type": 5})
    small = Envelope({h.MESSAGE_ID: "m", h.MESSAGE_TYPE: "claims.StoreBlob"}, "{}")
    assert check.applies(small)
    assert not check.applies(Envelope({h.MESSAGE_ID: "m", h.MESSAGE_TYPE: "claims.Upload"},
                                      "x" * 1000))
    assert check.applies(Envelope({h.MESSAGE_ID: "m", h.MESSAGE_TYPE: "other.Type"}, "é" * 3))
    # a message already carrying a reference is never claim-checked again
    assert not check.applies(small.with_headers({h.CLAIM_CHECK: "p"}))


def test_claim_check_options_are_checked_when_the_endpoint_is_built() -> None:
    with pytest.raises(ConfigurationError, match="PayloadStore"):
        ClaimCheck(store=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="threshold_bytes"):
        ClaimCheck(threshold_bytes=-1)
    with pytest.raises(ConfigurationError, match="retention"):
        ClaimCheck(retention=datetime.timedelta(0))
    with pytest.raises(ConfigurationError, match="claim_check must be"):
        Endpoint("e", claim_check=True)  # type: ignore[arg-type]


class Refusing(Handler):
    """Fails every blob: the message goes to the error queue."""

    @handles
    def store(self, message: StoreBlob) -> None:
        raise ValueError(f"no room for {message.name}")


def test_errors_show_resolves_a_claim_checked_body_in_the_error_queue(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a claim-checked message in the error queue (its handler failed for good)
    payloads = SharedMemoryStorage()
    receiver = make_endpoint("blobs", handlers=[Refusing()], claim_check=ClaimCheck(
        store=payloads), recoverability=Recoverability(retries=NO_RETRIES))
    dead = SignalCounter(receiver, "dead_lettered")
    sender = make_endpoint("uploads", claim_check=ClaimCheck(threshold_bytes=1000,
                                                             store=payloads))
    module = types.ModuleType(f"claims_errors_{uuid.uuid4().hex[:8]}")
    tool_storage = SharedMemoryStorage()  # the tool's database: one for every run
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        receiver.name, transport=shared_in_this_process(make_transport()),
        storage=tool_storage, error_queue=receiver.error_queue,
        claim_check=ClaimCheck(store=payloads))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with receiver, sender:
        message_id = sender.bus.send(StoreBlob(name="refused", data=blob("refused", 50_000)),
                                     to=receiver.name)
        assert dead.wait_for(1)

    # When it is shown
    status, out, _ = idembus(capsys, "show", f"{module.__name__}:endpoint", message_id,
                             "--json")

    # Then the reference is kept and the body it names is shown: its size and its start
    assert status == 0
    [shown] = json.loads(out)
    assert shown["headers"][h.CLAIM_CHECK] == payload_id(message_id)
    claimed = shown["claim_check"]
    body = payloads.get_payload(payload_id(message_id))
    assert body is not None
    assert claimed["found"] is True and claimed["bytes"] == len(body)
    assert claimed["prefix"] == body.decode()[:2000] and claimed["truncated"] is True
    status, out, _ = idembus(capsys, "show", f"{module.__name__}:endpoint", message_id)
    assert f"claim-checked body, {len(body)} bytes (the first 2000 characters):" in out

    # And once the body is collected (its hold released behind the tool's back), it says
    # so instead
    far = utc_now() + datetime.timedelta(days=3650)
    assert payloads.collect_payloads(far) == 0  # the copy in the error queue holds it
    assert payloads.release_payload(shown["headers"][h.CLAIM_CHECK_HOLD], keep_until=utc_now())
    assert payloads.collect_payloads(far) == 1
    status, out, _ = idembus(capsys, "show", f"{module.__name__}:endpoint", message_id)
    assert status == 0
    assert "claim-checked body: cannot be read:" in out and "not in the payload store" in out


def test_errors_export_writes_claim_checked_bodies_resolved_or_says_why_not(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:
    # Given two claim-checked messages in the error queue, the body of one of them gone
    payloads = SharedMemoryStorage()
    receiver = make_endpoint("blobs", handlers=[Refusing()], claim_check=ClaimCheck(
        store=payloads), recoverability=Recoverability(retries=NO_RETRIES))
    dead = SignalCounter(receiver, "dead_lettered")
    sender = make_endpoint("uploads", claim_check=ClaimCheck(threshold_bytes=1000,
                                                             store=payloads))
    module = types.ModuleType(f"claims_export_{uuid.uuid4().hex[:8]}")
    tool_storage = SharedMemoryStorage()
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        receiver.name, transport=shared_in_this_process(make_transport()),
        storage=tool_storage, error_queue=receiver.error_queue,
        claim_check=ClaimCheck(store=payloads))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with receiver, sender:
        kept = sender.bus.send(StoreBlob(name="kept", data=blob("kept", 30_000)),
                               to=receiver.name)
        lost = sender.bus.send(StoreBlob(name="lost", data=blob("lost", 40_000)),
                               to=receiver.name)
        assert dead.wait_for(2)
    status, out, _ = idembus(capsys, "show", f"{module.__name__}:endpoint", lost, "--json")
    [shown] = json.loads(out)
    assert payloads.release_payload(shown["headers"][h.CLAIM_CHECK_HOLD], keep_until=utc_now())
    assert payloads.collect_payloads(utc_now() + datetime.timedelta(days=3650)) == 1

    # When the error queue is exported
    export = tmp_path / "failed.jsonl"
    status, out, err = idembus(capsys, "export", f"{module.__name__}:endpoint", str(export))

    # Then the kept body is written whole, without its references; the lost one with its
    # reference and why it cannot be read
    assert status == 0 and "2 message(s)" in out
    assert "1 of them refer to claim-checked content that cannot be read" in err
    lines = {line["message_id"]: line for line in map(json.loads, export.read_text().splitlines())}
    assert StoreBlob.model_validate_json(lines[kept]["body"]).data == blob("kept", 30_000)
    assert lines[kept]["claim_check"] == {"payload_ids": [payload_id(kept)], "resolved": True}
    assert h.CLAIM_CHECK not in json.loads(lines[kept]["headers"])
    assert json.loads(lines[lost]["body"])[h.CLAIM_CHECK] == payload_id(lost)
    assert json.loads(lines[lost]["headers"])[h.CLAIM_CHECK] == payload_id(lost)
    problem = lines[lost]["claim_check"]["problem"]
    assert problem.startswith("cannot be read: ") and "not in the payload store" in problem


class FetchBlob(Command, message_name="claims.FetchBlob"):
    name: str
    size: int


class BlobStore(Handler):
    """Answers a FetchBlob with the blob itself."""

    @handles
    def fetch(self, message: FetchBlob) -> None:
        self.bus.reply(StoreBlob(name=message.name, data=blob(message.name, message.size)))


def test_a_large_reply_to_an_awaited_request_is_resolved_for_the_requester(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a responder whose replies are claim-checked, and a requester reading its store
    payloads = MemoryStorage()
    responder = make_endpoint("store", handlers=[BlobStore()], claim_check=ClaimCheck(
        threshold_bytes=THRESHOLD, store=payloads))
    requester = make_endpoint("shop", routes={FetchBlob: responder.name},
                              claim_check=ClaimCheck(store=payloads))
    with responder, requester:
        # When the requester waits for a large reply
        reply = requester.bus.request(FetchBlob(name="asked", size=300_000), timeout=20)
    # Then it gets the whole message, and the body went through the store
    assert isinstance(reply, StoreBlob) and reply.data == blob("asked", 300_000)
    assert payloads.collect_payloads(utc_now() + datetime.timedelta(days=3650)) == 1


class Unreachable(Watched):
    """A payload store whose first reads fail as an outage."""

    def __init__(self, store: PayloadStore, outages: int) -> None:
        super().__init__(store)
        self.outages = outages

    def get_payload(self, payload_id: str) -> bytes | None:
        if self.outages:
            self.outages -= 1
            raise StorageUnavailable("the payload store is down")
        return super().get_payload(payload_id)


def test_a_reference_waits_out_an_outage_of_the_store_and_spends_no_retry(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a receiver whose payload store is unreachable for its first three reads
    payloads = MemoryStorage()
    flaky = Unreachable(payloads, outages=3)
    blobs = Blobs()
    receiver = make_endpoint("blobs", handlers=[blobs], claim_check=ClaimCheck(store=flaky),
                             recoverability=Recoverability(retries=NO_RETRIES,
                                                           outage_backoff=Backoff((0.01,))))
    sender = make_endpoint("uploads", claim_check=ClaimCheck(threshold_bytes=THRESHOLD,
                                                             store=payloads))
    with receiver, sender:
        # When a claim-checked message arrives
        sender.bus.send(StoreBlob(name="patient", data=blob("patient", 100_000)),
                        to=receiver.name)
        wait_until_idle([receiver, sender])
    # Then it waited for the store and was handled, neither failed nor dead-lettered
    assert blobs.received == [("patient", 100_000, True)]
    assert flaky.outages == 0
    assert receiver.counters["failed"] == receiver.counters["dead_lettered"] == 0
