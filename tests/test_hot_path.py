"""The shortcuts of the per-message path behave as the plain code they replace: the log
fields of the message being processed, the receivers a signal remembers between sends."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from idembus.logs import current_context, message_context
from idembus.signals import EndpointSignals


def test_message_context_fields_nest_drop_none_and_are_restored() -> None:
    # Given no fields, when blocks are nested, then the inner one sees both and None
    # removes a field; leaving each block restores the fields before it.
    assert current_context() == {}
    with message_context(endpoint="sales", message_id="m-1"):
        assert current_context() == {"endpoint": "sales", "message_id": "m-1"}
        with message_context(handler="OrderHandler", attempt=1, message_id=None):
            assert current_context() == {"endpoint": "sales", "handler": "OrderHandler",
                                         "attempt": 1}
        assert current_context() == {"endpoint": "sales", "message_id": "m-1"}
    assert current_context() == {}


def test_message_context_is_restored_when_the_block_raises() -> None:
    try:
        with message_context(endpoint="sales"):
            raise KeyError("boom")
    except KeyError:
        pass
    assert current_context() == {}


def test_a_signal_calls_receivers_connected_and_forgets_those_disconnected_between_sends(
) -> None:
    signals = EndpointSignals("sales")
    seen: list[tuple[str, Any]] = []

    def first(sender: str, **details: Any) -> None:
        seen.append(("first", details["message_id"]))

    def second(sender: str, **details: Any) -> None:
        seen.append(("second", details["message_id"]))

    def other_endpoint(sender: str, **details: Any) -> None:
        seen.append(("other", details["message_id"]))

    signals.handled.connect(first)
    signals.emit("handled", message_id="1")
    signals.handled.connect(second, sender="sales")  # after a send: not remembered yet
    signals.handled.connect(other_endpoint, sender="billing")
    signals.emit("handled", message_id="2")
    signals.handled.disconnect(first)
    signals.emit("handled", message_id="3")
    assert sorted(seen) == [("first", "1"), ("first", "2"), ("second", "2"), ("second", "3")]


def test_a_signal_skips_a_weakly_connected_receiver_once_it_is_collected() -> None:
    signals = EndpointSignals("sales")
    seen: list[str] = []

    class Observer:
        def on_handled(self, sender: str, **details: Any) -> None:
            seen.append(details["message_id"])

    observer = Observer()
    signals.handled.connect(observer.on_handled)  # weak, blinker's default
    signals.emit("handled", message_id="1")
    del observer
    gc.collect()
    signals.emit("handled", message_id="2")
    assert seen == ["1"]
    assert not signals.handled.receivers


def test_a_signal_calls_weak_methods_on_their_instance_and_strong_receivers_from_its_cache(
) -> None:
    signals = EndpointSignals("sales")
    seen: list[tuple[str, str, str]] = []

    class Observer:
        def __init__(self, name: str) -> None:
            self.name = name

        def on_settled(self, sender: str, *, outcome: str, **details: Any) -> None:
            seen.append((self.name, sender, outcome))

    first, second = Observer("first"), Observer("second")
    signals.settled.connect(first.on_settled)  # weak: blinker keeps a WeakMethod
    signals.settled.connect(second.on_settled, weak=False)
    for outcome in ("handled", "duplicate"):  # the second send from the remembered pairs
        signals.emit("settled", outcome=outcome)
    assert sorted(seen) == [("first", "sales", "duplicate"), ("first", "sales", "handled"),
                            ("second", "sales", "duplicate"), ("second", "sales", "handled")]
    collected = weakref.ref(first)
    del first
    gc.collect()
    assert collected() is None  # the remembered pair did not keep the instance alive
    signals.emit("settled", outcome="handled")
    assert seen[-1] == ("second", "sales", "handled") and len(seen) == 5


def test_derived_ids_are_the_uuid5_of_their_name() -> None:
    import uuid

    from idembus.context import IDEMBUS_NAMESPACE, MessageContext, derived_id

    for name in ["", "OrderHandler/1/0", "Ünïcode/ä/7", "x" * 500]:
        assert derived_id(name) == str(uuid.uuid5(IDEMBUS_NAMESPACE, name))
    context = MessageContext(message_id="m-1", message_type="T", headers={},
                             handler_name="H", endpoint="e")
    assert context.outgoing_id(3) == str(uuid.uuid5(IDEMBUS_NAMESPACE, "H/m-1/3"))
    assert context.idempotency_key == str(uuid.uuid5(IDEMBUS_NAMESPACE, "H/m-1"))


def test_the_broker_s_headers_are_left_out_and_the_sender_s_kept_as_they_are() -> None:
    from idembus.transports.kombu_delivery import _senders_headers

    plain = {"idembus.message_id": "m", "tenant": "a", "max-x-y": "1"}
    assert _senders_headers(plain) is plain  # nothing named x-...: no copy
    assert _senders_headers({"x-death": [{}], "x-first-death-queue": "q", "a": "1",
                             "x-delivery-count": 2, "x-mine": "kept"}) == {
        "a": "1", "x-mine": "kept"}
    assert _senders_headers({"b": "2", "x-last-death-reason": "expired"}) == {"b": "2"}
    assert _senders_headers({b"\xff": "raw", "x-death": []}) == {b"\xff": "raw"}


def test_a_handler_is_copied_as_copy_copy_copies_it() -> None:
    import copy

    from idembus.handlers import Handler
    from idembus.runtime.invocation import _shallow_copy

    class Plain(Handler):
        def __init__(self) -> None:
            self.gateway = object()

    class OwnCopy(Handler):
        def __copy__(self) -> OwnCopy:
            twin = OwnCopy()
            twin.copied = True  # type: ignore[attr-defined]
            return twin

    class Slotted:
        __slots__ = ("gateway",)

        def __init__(self) -> None:
            self.gateway = object()

    plain = Plain()
    twin = _shallow_copy(plain)
    assert twin is not plain and type(twin) is Plain
    assert twin.gateway is plain.gateway and vars(twin) == vars(plain)
    twin.bus = "its own"
    assert not hasattr(plain, "bus")
    assert _shallow_copy(OwnCopy()).copied  # type: ignore[attr-defined]
    slotted = Slotted()
    assert _shallow_copy(slotted).gateway is copy.copy(slotted).gateway


def test_memory_storage_builds_its_records_as_the_dataclasses_would() -> None:
    # Given MemoryStorage's shortcut constructors (a frozen dataclass's fields are its
    # instance __dict__ only without slots and __post_init__), when a record and an entry
    # are built with every field, then they equal, and hold exactly the fields of, the
    # records the dataclasses build.
    import dataclasses
    import datetime

    from idembus.storage.base import AggregateRecord, ProcessedMessage
    from idembus.storage.memory import _entry, _record

    for cls in (AggregateRecord, ProcessedMessage):
        assert not hasattr(cls, "__slots__") and not hasattr(cls, "__post_init__")
    at = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    entry = _entry("H/m-1", (), ("o-1",), True, at, 2, "PlaceOrder")
    assert entry == ProcessedMessage("H/m-1", (), ("o-1",), True, at, 2,
                                     message_type="PlaceOrder")
    record = _record("Order", "o-1", 3, {"n": 1}, {"H/m-1": entry}, at, True, 2, {"n": 2})
    assert record == AggregateRecord("Order", "o-1", 3, {"n": 1}, {"H/m-1": entry}, at, True,
                                     2, {"n": 2})
    for built, cls in ((entry, ProcessedMessage), (record, AggregateRecord)):
        assert list(vars(built)) == [field.name for field in dataclasses.fields(cls)]


def test_hand_written_initialisers_of_frozen_records_take_and_set_every_field() -> None:
    # Given the records built for every message whose __init__ is written by hand (one
    # update of the instance dict instead of a frozen dataclass's object.__setattr__ per
    # field), then each takes exactly the dataclass's fields with their defaults, in order,
    # and sets them all (a field added later and forgotten here fails this test).
    import dataclasses
    import inspect

    from idembus.context import MessageContext
    from idembus.envelope import Envelope
    from idembus.runtime.invocation import Outcome

    for cls in (Envelope, MessageContext, Outcome):
        fields = dataclasses.fields(cls)
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert [(p.name, p.default) for p in parameters] == [
            (f.name, inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
            for f in fields]
        built = cls(*[f"value-{index}" for index in range(len(fields))])
        assert vars(built) == {f.name: f"value-{index}" for index, f in enumerate(fields)}
        assert dataclasses.replace(built) == built
        try:
            built.__setattr__(fields[0].name, "changed")
        except dataclasses.FrozenInstanceError:
            pass
        else:
            raise AssertionError(f"{cls.__name__} is no longer frozen")


def test_a_delivery_standing_for_another_takes_every_field_init_sets() -> None:
    # Given a delivery built by Delivery.__init__, when a held delivery of a batch stands
    # for it, then it has every field __init__ set, with the original's values (a field
    # added to __init__ and forgotten in _stand_for fails this test), and is unsettled.
    from idembus.runtime.batch_runner import _HeldDelivery
    from idembus.transports.base import Delivery

    class _Plain(Delivery):
        def _ack(self) -> None: ...

        def _requeue(self) -> None: ...

    original = _Plain(queue="q", headers={"a": "1"}, body=b"{}", content_type="ct",
                      redelivered=True, wire_error="bad", content_encoding="utf-8")
    held = _HeldDelivery(original)
    shared = {name: value for name, value in vars(held).items()
              if name not in ("original", "ack_at_once", "acked")}
    assert shared == vars(original)


def test_format_utc_is_isoformat_in_utc() -> None:
    # Given moments in UTC and in other zones, with and without microseconds, in early
    # years too, then the header is what isoformat gives of the moment in UTC.
    import datetime

    from idembus.envelope import format_utc

    utc = datetime.timezone.utc
    plus_two = datetime.timezone(datetime.timedelta(hours=2))
    for moment in (datetime.datetime(2026, 11, 28, 17, 3, 9, 4005, tzinfo=utc),
                   datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=utc),
                   datetime.datetime(999, 12, 31, 23, 59, 59, 999999, tzinfo=utc),
                   datetime.datetime(2026, 3, 1, 1, 0, 0, 1, tzinfo=plus_two),
                   datetime.datetime.now(utc)):
        assert format_utc(moment) == moment.astimezone(utc).isoformat()


def test_derived_ids_are_uuid5_of_the_idembus_namespace() -> None:
    import uuid

    from idembus.context import IDEMBUS_NAMESPACE, derived_id

    for index in range(2000):
        name = f"OrderHandler/{uuid.UUID(int=index * 7919)}/{index}"
        assert derived_id(name) == str(uuid.uuid5(IDEMBUS_NAMESPACE, name))


def test_tallies_are_counted_by_emit_and_by_a_plain_send() -> None:
    # Given the endpoint's counters (Tally receivers, counted by emit without a call),
    # when a signal is emitted, sent through blinker, and emitted after another receiver
    # connected, then every send is counted once and the other receiver gets the details.
    from idembus.runtime.counters import Counters

    signals = EndpointSignals("sales")
    counters = Counters(signals)
    signals.emit("handled", message_id="m-1", message_type="T")
    signals.handled.send("sales", message_id="m-2", message_type="T")
    seen: list[dict[str, Any]] = []
    signals.handled.connect(lambda sender, **details: seen.append(details), weak=False)
    signals.emit("handled", message_id="m-3", message_type="T")
    assert counters["handled"] == 3
    assert seen == [{"message_id": "m-3", "message_type": "T"}]


def test_memory_routes_follow_the_bindings_of_the_exchange() -> None:
    # Given a memory:// topic exchange whose routes for a key were remembered, when a
    # binding is added and another removed, then the queues are worked out again.
    from idembus.transports.kombu_in_process import routed_queues

    class _State:
        exchanges = {"events": {"type": "topic", "table": [("A", None, "q1")]}}

    class _Channel:
        state = _State()

    channel = _Channel()
    assert routed_queues(channel, "events", "A") == {"q1"}
    table = _State.exchanges["events"]["table"]
    table.append(("#", r"^.*?$", "q2"))
    assert routed_queues(channel, "events", "A") == {"q1", "q2"}
    table[:] = [("#", r"^.*?$", "q2")]
    assert routed_queues(channel, "events", "A") == {"q2"}
    assert routed_queues(channel, "missing", "A") == set()
