"""Field-level claim check (``ClaimCheck(fields={Type: ["field"]})``): a large field is kept
in the payload store on its own, the rest of the body travels inline, and the receiver puts
the field back before validation.

Requirement: the field reaches its handler whole while the wire body keeps every other
field readable and a reference in the field's place; each field has one payload under an
id derived from the message id and the field's name, written just before each publish (a
crash between the write and the publish sends the same reference again); a field below the
threshold travels inline; a missing field payload sends the message to the error queue with
the reason, and the error-queue copy holds the field's payload. Run on memory://, RabbitMQ
and Redis, with the payloads in memory, mongomock and PostgreSQL.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator

import pytest

from idembus import (
    ClaimCheck,
    Command,
    ConfigurationError,
    Endpoint,
    KombuTransport,
    Recoverability,
)
from idembus import headers as h
from idembus.envelope import Envelope, utc_now
from idembus.handlers import Handler, handles
from idembus.storage.base import PayloadStore
from idembus.storage.claims import field_payload_id, payload_id
from idembus.testing import wait_until_idle
from tests.payload_stores import payload_store
from tests.support import SignalCounter
from tests.test_claim_check import Watched, WireHeaders, blob
from tests.test_cli_errors import NO_RETRIES, SharedMemoryStorage, idembus, shared_in_this_process

MakeEndpoint = Callable[..., Endpoint]
THRESHOLD = 16 * 1024


class BigReport(Command, message_name="claims.BigReport"):
    title: str
    region: str
    pdf: str
    pages: list[int] = []


class Publish(Command, message_name="claims.Publish"):
    title: str
    size: int


class Publisher(Handler):
    """Sends the report a Publish asks for (a handler's message: committed, then sent)."""

    sends = (BigReport,)

    @handles
    def publish(self, message: Publish) -> None:
        self.bus.send(BigReport(title=message.title, region="eu",
                                pdf=blob(message.title, message.size), pages=[1, 2, 3]))


class Reports(Handler):
    def __init__(self) -> None:
        self.received: list[tuple[str, str, int, bool, list[int]]] = []
        self._lock = threading.Lock()

    @handles
    def report(self, message: BigReport) -> None:
        size = len(message.pdf)
        with self._lock:
            self.received.append((message.title, message.region, size,
                                  message.pdf == blob(message.title, size), message.pages))


class Refusing(Handler):
    @handles
    def report(self, message: BigReport) -> None:
        raise ValueError(f"no room for {message.title}")


@pytest.fixture(params=["memory", "mongomock",
                        pytest.param("postgres", marks=pytest.mark.postgres)])
def payloads(request: pytest.FixtureRequest, unique: str) -> Iterator[PayloadStore]:
    """The payload store the endpoints of a test share."""
    with payload_store(request.param, f"fields-{unique}", f"f{unique}") as store:
        yield store


def sender_check(store: PayloadStore) -> ClaimCheck:
    return ClaimCheck(threshold_bytes=THRESHOLD, fields={BigReport: ["pdf"]}, store=store)


def test_a_large_field_travels_apart_and_the_rest_of_the_body_inline(
    make_endpoint: MakeEndpoint, payloads: PayloadStore,
) -> None:
    # Given a sender that claim-checks BigReport.pdf over 16 KiB, and its receiver
    reports, wire = Reports(), WireHeaders()
    receiver = make_endpoint("reports", handlers=[reports], middleware=[wire],
                             claim_check=ClaimCheck(store=payloads))
    sender = make_endpoint("publisher", handlers=[Publisher], claim_check=sender_check(payloads),
                           routes={BigReport: receiver.name})
    with receiver, sender:
        # When a handler sends a report with a large pdf, and one with a small pdf is sent
        sender.bus.send(Publish(title="large", size=300_000), to=sender.name)
        small_id = sender.bus.send(BigReport(title="small", region="us", pdf=blob("small", 100)))
        wait_until_idle([receiver, sender])

    # Then both reached the handler whole
    assert sorted(reports.received) == [("large", "eu", 300_000, True, [1, 2, 3]),
                                        ("small", "us", 100, True, [])]
    # And only the large pdf went apart, under its field's id; the body stayed inline
    by_id = {headers[h.MESSAGE_ID]: headers for headers in wire.seen}
    assert h.CLAIM_CHECK_FIELDS not in by_id[small_id]
    [large] = [headers for message_id, headers in by_id.items() if message_id != small_id]
    assert h.CLAIM_CHECK not in large
    reference = field_payload_id(large[h.MESSAGE_ID], "pdf")
    stored = payloads.get_payload(reference)
    assert stored is not None and json.loads(stored) == blob("large", 300_000)
    assert json.loads(large[h.CLAIM_CHECK_FIELDS]) == {
        "pdf": {"id": reference, "bytes": len(stored)}}
    assert payloads.get_payload(payload_id(large[h.MESSAGE_ID])) is None  # no whole body
    assert receiver.counters["dead_lettered"] == 0


def test_a_copy_in_the_error_queue_shows_the_rest_inline_and_holds_the_field(
    make_endpoint: MakeEndpoint, payloads: PayloadStore,
) -> None:
    # Given a report with a claim-checked pdf whose handler fails for good
    receiver = make_endpoint("reports", handlers=[Refusing()], claim_check=ClaimCheck(
        store=payloads), recoverability=Recoverability(retries=NO_RETRIES))
    dead = SignalCounter(receiver, "dead_lettered")
    sender = make_endpoint("publisher", claim_check=sender_check(payloads))
    with receiver, sender:
        message_id = sender.bus.send(BigReport(title="held", region="eu",
                                               pdf=blob("held", 50_000)), to=receiver.name)
        assert dead.wait_for(1)
        wait_until_idle([receiver, sender])
        copy = receiver.transport.get(receiver.error_queue)
    # Then the copy's body keeps every other field, and a reference in the pdf's place
    assert copy is not None
    body = json.loads(copy.body)
    reference = field_payload_id(message_id, "pdf")
    assert body["title"] == "held" and body["region"] == "eu"
    assert body["pdf"] == {h.CLAIM_CHECK: reference, "bytes": 50_002}
    # And the field's payload outlives its retention while the copy is there
    assert h.CLAIM_CHECK_HOLD in copy.headers
    assert payloads.collect_payloads(utc_now() + datetime.timedelta(days=3650)) == 0
    assert payloads.get_payload(reference) is not None


def test_a_crash_between_the_fields_write_and_the_publish_sends_the_same_reference_again(
    make_endpoint: MakeEndpoint, payloads: PayloadStore,
) -> None:
    # Given a sender whose process dies right after writing the field, before publishing
    watched = Watched(payloads, crash_after_first_write=True)
    reports, wire = Reports(), WireHeaders()
    receiver = make_endpoint("reports", handlers=[reports], middleware=[wire],
                             claim_check=ClaimCheck(store=payloads))
    sender = make_endpoint("publisher", handlers=[Publisher], claim_check=sender_check(watched),
                           routes={BigReport: receiver.name})
    with receiver, sender:
        # When a handler's report is committed and its delivery comes back
        sender.bus.send(Publish(title="crashy", size=100_000), to=sender.name)
        wait_until_idle([receiver, sender])
    # Then it was handled once, whole, the same field id written twice
    assert reports.received == [("crashy", "eu", 100_000, True, [1, 2, 3])]
    [headers] = wire.seen
    assert watched.writes == [field_payload_id(headers[h.MESSAGE_ID], "pdf")] * 2
    assert sender.counters["duplicate"] == 1


def test_a_missing_field_payload_goes_to_the_error_queue_with_the_reason(
    make_endpoint: MakeEndpoint, payloads: PayloadStore,
) -> None:
    # Given a receiver whose store lacks the pdf a report refers to
    reports = Reports()
    receiver = make_endpoint("reports", handlers=[reports],
                             claim_check=ClaimCheck(store=payloads))
    dead = SignalCounter(receiver, "dead_lettered")
    message_id = str(uuid.uuid4())
    reference = field_payload_id(message_id, "pdf")
    with receiver:
        # When such a message arrives
        receiver.transport.send(Envelope(
            headers={h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "claims.BigReport",
                     h.CLAIM_CHECK_FIELDS: json.dumps({"pdf": {"id": reference,
                                                               "bytes": 9}})},
            body=json.dumps({"title": "t", "region": "r",
                             "pdf": {h.CLAIM_CHECK: reference, "bytes": 9}}),
            destination=receiver.name))
        assert dead.wait_for(1)
        wait_until_idle([receiver])
        copy = receiver.transport.get(receiver.error_queue)
    # Then it went to the error queue unhandled and unretried, the reason naming the field
    assert reports.received == []
    assert copy is not None
    assert copy.headers[h.EXCEPTION_TYPE] == "idembus.errors.MalformedMessage"
    assert "field 'pdf'" in copy.headers[h.EXCEPTION_MESSAGE]
    assert "not in the payload store" in copy.headers[h.EXCEPTION_MESSAGE]
    assert copy.headers[h.CLAIM_CHECK_FIELDS] == json.dumps({"pdf": {"id": reference,
                                                                     "bytes": 9}})
    assert receiver.counters["failed"] == 0


@pytest.mark.parametrize("header", [
    "not json", "[]", "{}", '{"pdf": "id"}', '{"pdf": {"id": "", "bytes": 1}}',
    '{"pdf": {"id": "x", "bytes": -1}}', '{"pdf": {"id": "x", "bytes": true}}',
])
def test_a_fields_header_that_cannot_be_read_is_refused_as_malformed(header: str) -> None:
    from idembus.errors import MalformedMessage
    from idembus.storage.claims import resolved

    with pytest.raises(MalformedMessage, match="idembus.claim_check.fields"):
        resolved({h.CLAIM_CHECK_FIELDS: header}, b'{"pdf": null}', SharedMemoryStorage())


def test_field_options_are_checked_when_the_claim_check_is_built() -> None:
    with pytest.raises(ConfigurationError, match="has no field 'pfd'"):
        ClaimCheck(fields={BigReport: ["pfd"]})
    with pytest.raises(ConfigurationError, match="lists of field names"):
        ClaimCheck(fields={BigReport: "pdf"})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="lists of field names"):
        ClaimCheck(fields={BigReport: []})
    check = ClaimCheck(fields={"claims.BigReport": ["pdf"]}, threshold_bytes=10)
    assert check.fields == {"claims.BigReport": ("pdf",)}
    # a type with fields is never claim-checked whole
    assert not check.applies(Envelope({h.MESSAGE_ID: "m", h.MESSAGE_TYPE: "claims.BigReport"},
                                      "x" * 1000))


def test_errors_show_and_export_read_claim_checked_fields(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:
    # Given a report with a claim-checked pdf in the error queue
    payloads = SharedMemoryStorage()
    receiver = make_endpoint("reports", handlers=[Refusing()], claim_check=ClaimCheck(
        store=payloads), recoverability=Recoverability(retries=NO_RETRIES))
    dead = SignalCounter(receiver, "dead_lettered")
    sender = make_endpoint("publisher", claim_check=sender_check(payloads))
    module = types.ModuleType(f"claims_fields_{uuid.uuid4().hex[:8]}")
    tool_storage = SharedMemoryStorage()
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        receiver.name, transport=shared_in_this_process(make_transport()),
        storage=tool_storage, error_queue=receiver.error_queue,
        claim_check=ClaimCheck(store=payloads))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    pdf = blob("shown", 40_000)
    with receiver, sender:
        message_id = sender.bus.send(BigReport(title="shown", region="eu", pdf=pdf),
                                     to=receiver.name)
        assert dead.wait_for(1)
    reference = f"{module.__name__}:endpoint"

    # When it is shown: the field's size and start, after the inline body
    status, out, _ = idembus(capsys, "show", reference, message_id, "--json")
    assert status == 0
    [shown] = json.loads(out)
    field = shown["claim_checked_fields"]["pdf"]
    assert field["found"] is True and field["bytes"] == len(pdf) + 2
    assert field["payload_id"] == field_payload_id(message_id, "pdf")
    assert field["prefix"] == json.dumps(pdf)[:2000] and "claim_check" not in shown
    status, out, _ = idembus(capsys, "show", reference, message_id)
    assert f"claim-checked field 'pdf', {len(pdf) + 2} bytes (the first 2000" in out

    # When it is exported: the body whole, without the references
    export = tmp_path / "failed.jsonl"
    status, _, _ = idembus(capsys, "export", reference, str(export))
    assert status == 0
    [line] = [json.loads(text) for text in export.read_text().splitlines()]
    assert BigReport.model_validate_json(line["body"]).pdf == pdf
    assert h.CLAIM_CHECK_FIELDS not in json.loads(line["headers"])
    assert line["claim_check"]["resolved"] is True
