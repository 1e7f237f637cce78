"""Evolving messages: aliases for renamed types, ``message_version`` on the wire, and
upcasters applied before validation wherever a body is decoded — live consumption,
error-queue retries, journal reads (the gateway) — with refusals that say what to do.
(Spark replay: tests/test_spark_replay.py.)"""

from __future__ import annotations

import json
import sys
import types
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from idembus import Command, Endpoint, Event, RetryPolicy, upcaster
from idembus import headers as h
from idembus.cli import main
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError, InvalidMessage, MalformedMessage
from idembus.gateway.encoded import EventCache
from idembus.handlers import Handler, handles
from idembus.registry import MessageRegistry
from idembus.runtime.decoding import decode
from idembus.runtime.journal import current_entry
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.base import JournalEntry
from idembus.storage.memory import MemoryStorage
from idembus.transports.kombu import KombuTransport
from tests.support import SignalCounter
from tests.test_cli_errors import SharedMemoryStorage, shared_in_this_process

MakeEndpoint = Callable[..., Endpoint]
NO_RETRIES = Recoverability(retries=RetryPolicy(immediate_retries=0, delayed=()))


class Shipped(Event, message_name="evo.Shipped", aliases=("legacy.OrderShipped",),
              message_version=3):
    """Version 3. Version 1 was ``{"order": ..., "kg": float}``; version 2 renamed
    ``order`` to ``order_id``; version 3 weighs in grams."""

    order_id: str
    grams: int


@upcaster(Shipped, from_version=1)
def _order_to_order_id(body: dict[str, Any]) -> dict[str, Any]:
    body["order_id"] = body.pop("order")
    return body


@upcaster(Shipped, from_version=2)
def _kilograms_to_grams(body: dict[str, Any]) -> dict[str, Any]:
    return {"order_id": body["order_id"], "grams": round(body.pop("kg") * 1000)}


def wire(message_type: str, body: dict[str, Any], version: int | None) -> dict[str, str]:
    headers = {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: message_type}
    if version is not None:
        headers[h.MESSAGE_VERSION] = str(version)
    return headers


def decoded(message_type: str, body: dict[str, Any], version: int | None) -> Any:
    return decode(wire(message_type, body, version), json.dumps(body).encode(),
                  h.CONTENT_TYPE, MessageRegistry([Shipped]))


# -- aliases ----------------------------------------------------------------------------


def test_a_message_sent_under_an_alias_decodes_as_the_renamed_type():
    message = decoded("legacy.OrderShipped", {"order_id": "o-1", "grams": 5}, 3)

    assert message == Shipped(order_id="o-1", grams=5)


def test_an_alias_that_another_type_is_named_is_refused_when_the_endpoint_is_built():
    class Old(Event, message_name="legacy.OrderShipped"):
        pass

    class Both(Handler):
        @handles(Shipped, Old)
        def on(self, message: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="'legacy.OrderShipped'.*an alias"):
        Endpoint(f"alias-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(), handlers=[Both])


@pytest.mark.parametrize(("keywords", "says"), [
    ({"aliases": "legacy.Name"}, "aliases must be a tuple of names"),
    ({"aliases": ("New", "New")}, "repeat a name"),
    ({"message_name": "New", "aliases": ("New",)}, "repeat a name"),
    ({"aliases": ("bad name",)}, "alias 'bad name' must start with a letter"),
    ({"message_version": 0}, "message_version must be a whole number from 1"),
    ({"message_version": True}, "message_version must be a whole number from 1"),
])
def test_wrong_class_keywords_fail_when_the_class_is_defined(keywords: dict[str, Any],
                                                               says: str):
    with pytest.raises(ConfigurationError, match=says):
        type("New", (Command,), {"__annotations__": {}}, **keywords)


# -- versions and upcasters -------------------------------------------------------------


@pytest.mark.parametrize(("version", "body"), [
    (None, {"order": "o-1", "kg": 1.25}),  # before versions existed: version 1
    (1, {"order": "o-1", "kg": 1.25}),
    (2, {"order_id": "o-1", "kg": 1.25}),
    (3, {"order_id": "o-1", "grams": 1250}),
])
def test_every_older_version_is_upcast_step_by_step_into_the_current_shape(
    version: int | None, body: dict[str, Any],
):
    assert decoded("evo.Shipped", body, version) == Shipped(order_id="o-1", grams=1250)


def test_a_body_newer_than_the_class_is_refused_with_what_to_deploy():
    with pytest.raises(InvalidMessage, match="version 4 of Shipped, newer than the version 3"):
        decoded("evo.Shipped", {"order_id": "o", "grams": 1}, 4)


def test_a_version_header_that_is_not_a_whole_number_is_malformed():
    with pytest.raises(MalformedMessage, match="idembus.message_version"):
        decoded("evo.Shipped", {"order_id": "o", "grams": 1}, 0)


def test_a_version_without_a_step_and_a_failing_step_are_refused_not_guessed():
    class Parcel(Event, message_name="evo.Parcel", message_version=3):
        weight: int

    @upcaster(Parcel, from_version=2)
    def _fails(body: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("kg")

    registry = MessageRegistry([Parcel])
    with pytest.raises(InvalidMessage, match="no upcaster goes from version 1: add "
                                             r"@upcaster\(.*Parcel, from_version=1\)"):
        decode(wire("evo.Parcel", {}, 1), b"{}", None, registry)
    with pytest.raises(InvalidMessage, match="from version 2 .*_fails.* failed.*KeyError"):
        decode(wire("evo.Parcel", {}, 2), b"{}", None, registry)
    with pytest.raises(InvalidMessage, match="not a JSON object"):
        decode(wire("evo.Parcel", {}, 2), b"[1]", None, registry)


def test_a_step_the_class_cannot_have_or_a_second_one_fails_at_definition():
    class Small(Command, message_version=2):
        pass

    with pytest.raises(ConfigurationError, match="a step starts from a version in 1..1"):
        upcaster(Small, from_version=2)
    with pytest.raises(ConfigurationError, match="raise its version first"):
        upcaster(_V1, from_version=1)

    @upcaster(Small, from_version=1)
    def _first(body: dict[str, Any]) -> dict[str, Any]:
        return body

    with pytest.raises(ConfigurationError, match="two upcasters from version 1"):
        @upcaster(Small, from_version=1)
        def _second(body: dict[str, Any]) -> dict[str, Any]:
            return body


class _V1(Command):
    pass


def test_a_gap_in_a_chain_fails_when_the_endpoint_is_built():
    class Gapped(Command, message_name="evo.Gapped", message_version=4):
        pass

    @upcaster(Gapped, from_version=1)
    def _one(body: dict[str, Any]) -> dict[str, Any]:
        return body

    @upcaster(Gapped, from_version=3)
    def _three(body: dict[str, Any]) -> dict[str, Any]:
        return body

    class Gaps(Handler):
        @handles(Gapped)
        def on(self, message: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="none from 2: add @upcaster"):
        Endpoint(f"gaps-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(), handlers=[Gaps])


# -- live consumption and the error queue -----------------------------------------------


class ShippedLog(Handler):
    def __init__(self) -> None:
        self.seen: list[Shipped] = []

    @handles
    def on(self, message: Shipped) -> None:
        self.seen.append(message)


def raw_send(endpoint: Endpoint, headers: dict[str, str], body: dict[str, Any]) -> None:
    endpoint.transport.send(Envelope(headers, json.dumps(body), endpoint.name))


def test_live_consumption_upcasts_old_bodies_and_dead_letters_newer_ones_with_the_reason(
    make_endpoint: MakeEndpoint,
):
    handler = ShippedLog()
    endpoint = make_endpoint("shipping", handlers=[handler], recoverability=NO_RETRIES)
    handled = SignalCounter(endpoint, "handled")
    dead = SignalCounter(endpoint, "dead_lettered")
    endpoint.start()

    raw_send(endpoint, wire("legacy.OrderShipped", {}, None), {"order": "o-1", "kg": 0.5})
    raw_send(endpoint, wire("evo.Shipped", {}, 2), {"order_id": "o-2", "kg": 2})
    raw_send(endpoint, wire("evo.Shipped", {}, 9), {"order_id": "o-3", "grams": 1})

    assert handled.wait_for(2) and dead.wait_for(1)
    assert handler.seen == [Shipped(order_id="o-1", grams=500),
                            Shipped(order_id="o-2", grams=2000)]
    copy = endpoint.transport.get(endpoint.error_queue)
    assert copy is not None and json.loads(copy.body) == {"order_id": "o-3", "grams": 1}
    assert "version 9 of Shipped, newer" in copy.headers[h.EXCEPTION_MESSAGE]
    assert copy.headers[h.IMMEDIATE_ATTEMPTS] == "0"  # never retried


class Weighed(Command, message_name="evo.Weighed"):
    """What a version-1 sender sends."""

    parcel: str
    kg: float


class WeighedV2(Command, message_name="evo.Weighed", message_version=2):
    """The same type at version 2, after the deploy."""

    parcel: str
    grams: int


@upcaster(WeighedV2, from_version=1)
def _weighed_in_grams(body: dict[str, Any]) -> dict[str, Any]:
    return {"parcel": body["parcel"], "grams": round(body["kg"] * 1000)}


def test_an_error_queue_retry_of_a_version_1_message_is_upcast_by_the_version_2_endpoint(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
):
    # Given a version-1 message that a broken version-1 handler sent to the error queue
    class Broken(Handler):
        @handles
        def on(self, message: Weighed) -> None:
            raise RuntimeError("the scale is broken")

    old = make_endpoint("scales", handlers=[Broken], recoverability=NO_RETRIES,
                        storage=SharedMemoryStorage())
    dead = SignalCounter(old, "dead_lettered")
    old.start()
    message_id = old.bus.send(Weighed(parcel="p-1", kg=1.5), to=old.name)
    assert dead.wait_for(1)
    old.stop()

    # When version 2 is deployed and the message retried from the error queue
    seen: list[WeighedV2] = []

    class Scales(Handler):
        @handles
        def on(self, message: WeighedV2) -> None:
            seen.append(message)

    new = Endpoint(old.name, transport=old.transport, storage=SharedMemoryStorage(),
                   handlers=[Scales], error_queue=old.error_queue)
    handled = SignalCounter(new, "handled")
    new.start()
    module = types.ModuleType(f"evolution_app_{uuid.uuid4().hex[:8]}")
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        old.name, transport=shared_in_this_process(make_transport()),
        storage=SharedMemoryStorage(), error_queue=old.error_queue)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        assert main(["errors", "retry", f"{module.__name__}:endpoint", message_id]) == 0

        # Then the original version-1 bytes are handled in the version-2 shape
        assert handled.wait_for(1)
        assert seen == [WeighedV2(parcel="p-1", grams=1500)]
    finally:
        new.stop()


# -- journal reads ----------------------------------------------------------------------


def journal_entry(message_type: str, body: dict[str, Any], version: int | None) -> JournalEntry:
    headers = wire(message_type, body, version)
    return JournalEntry(message_id=headers[h.MESSAGE_ID], message_type=message_type,
                        headers=headers, body=json.dumps(body), position=7)


def test_a_journal_entry_of_an_old_version_or_name_is_read_in_the_current_shape():
    entry = journal_entry("legacy.OrderShipped", {"order": "o-1", "kg": 0.25}, None)

    current = current_entry(entry, MessageRegistry([Shipped]))

    assert json.loads(current.body) == {"order_id": "o-1", "grams": 250}
    assert current.message_type == "evo.Shipped"
    assert current.headers[h.MESSAGE_TYPE] == "evo.Shipped"
    assert current.headers[h.MESSAGE_VERSION] == "3"
    assert (current.message_id, current.position) == (entry.message_id, 7)


def test_a_journal_entry_that_is_current_unknown_or_not_upcastable_is_served_as_stored(
    caplog: pytest.LogCaptureFixture,
):
    known = MessageRegistry([Shipped])
    current = journal_entry("evo.Shipped", {"order_id": "o", "grams": 1}, 3)
    unknown = journal_entry("other.Thing", {"x": 1}, 1)
    newer = journal_entry("evo.Shipped", {"order_id": "o", "grams": 1}, 5)

    assert current_entry(current, known) is current
    assert current_entry(unknown, known) is unknown
    assert current_entry(newer, known) is newer
    assert "journal entry 7 (evo.Shipped" in caplog.text


def test_the_gateway_encodes_journal_entries_after_upcasting_them(make_endpoint: MakeEndpoint):
    from idembus.gateway.service import _current_entries

    endpoint = make_endpoint("journaled", storage=MemoryStorage(), journal=[Shipped])
    cache = EventCache(current=_current_entries(endpoint))

    (event,) = cache.batch([journal_entry("evo.Shipped", {"order": "o-9", "kg": 1}, 1)]).events

    assert event.entry.message_type == "evo.Shipped"
    data = json.loads(event.data.decode().split("data: ", 1)[1])
    assert data["body"] == {"order_id": "o-9", "grams": 1000}
