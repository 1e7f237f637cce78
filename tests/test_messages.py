import pydantic
import pytest

from idembus import Command, ConfigurationError, Event, message_name
from idembus.errors import UnknownMessageType
from idembus.messages import is_message_type
from idembus.registry import MessageRegistry


class PlaceOrder(Command, message_name="sales.PlaceOrder"):
    order_id: str


class OrderPlaced(Event):
    order_id: str


class RushOrder(PlaceOrder):
    pass


def test_a_message_type_is_named_on_the_wire_by_its_message_name_keyword():
    assert message_name(PlaceOrder) == "sales.PlaceOrder"
    assert message_name(PlaceOrder(order_id="1")) == "sales.PlaceOrder"


def test_a_message_type_without_a_message_name_keyword_uses_its_class_name_not_its_import_path():
    assert message_name(OrderPlaced) == "OrderPlaced"


def test_a_subclass_does_not_inherit_its_parents_wire_name():
    assert message_name(RushOrder) == "RushOrder"


def test_a_wire_name_with_topic_wildcards_is_refused_at_class_definition():
    with pytest.raises(ConfigurationError, match="message name 'sales.#'"):
        class Bad(Command, message_name="sales.#"):
            pass


def test_pydantic_class_keywords_still_work_beside_the_name():
    class Frozen(Event, message_name="frozen.Thing", frozen=True):
        value: int

    assert message_name(Frozen) == "frozen.Thing"
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        Frozen(value=1).value = 2  # type: ignore[misc]


def test_only_concrete_command_and_event_subclasses_are_message_types():
    assert is_message_type(PlaceOrder) and is_message_type(OrderPlaced)
    assert not is_message_type(Command)
    assert not is_message_type(Event)
    assert not is_message_type(dict)
    assert not is_message_type(PlaceOrder(order_id="x"))


def test_two_types_with_one_wire_name_cannot_share_a_registry():
    class Twin(Command, message_name="sales.PlaceOrder"):
        pass

    with pytest.raises(ConfigurationError, match="share the wire name 'sales.PlaceOrder'"):
        MessageRegistry([PlaceOrder, Twin])


def test_the_registry_resolves_known_names_and_explains_unknown_ones():
    registry = MessageRegistry([PlaceOrder, OrderPlaced])
    assert registry.resolve("sales.PlaceOrder") is PlaceOrder
    with pytest.raises(UnknownMessageType, match="'nope'.*OrderPlaced, sales.PlaceOrder"):
        registry.resolve("nope")


def test_the_wire_name_keyword_is_message_name_because_name_breaks_python_3_10():
    # On Python 3.10, ABCMeta.__new__ takes `name` positionally: a class keyword `name=`
    # collides with it. `message_name=` is the one keyword idembus reads.
    with pytest.raises(TypeError):
        class Old(Command, name="x.Old"):  # type: ignore[call-arg]
            pass
