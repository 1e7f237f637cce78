"""Names are validated whole (issue 24, point 10): Python's ``$`` also matches before a
trailing newline, so ``re.match(r"^...$")`` let ``"sales\\n"`` through as a message,
endpoint, schedule or table-prefix name; validation uses ``re.fullmatch`` now. And an
aggregate type name is checked when its handler is registered: a line break in it wrote an
event of the attacker's choosing into the gateway's stream (``event: <type>`` is a line),
a ``/`` forged ``Type/id`` references, ``idembus_journal`` wrote aggregates into the
journal's MongoDB collection.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import BaseModel

from idembus import Command, Endpoint, Event, Schedule
from idembus.errors import ConfigurationError
from idembus.handlers import AggregateHandler, handles
from idembus.handlers.errors import HandlerDefinitionError
from idembus.handlers.registration import HandlerTable
from idembus.messages import parents_of
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.transports.database import check_prefix


class Ping(Command, message_name="names.Ping"):
    account: str = "a"


def test_a_message_name_with_a_trailing_newline_is_refused():
    with pytest.raises(ConfigurationError, match="message name"):
        class Bad(Command, message_name="sales.Bad\n"):
            pass


def test_an_alias_with_a_trailing_newline_is_refused():
    with pytest.raises(ConfigurationError):
        class Bad(Command, message_name="sales.Bad", aliases=("sales.Old\n",)):
            pass


def test_a_parent_with_a_trailing_newline_is_refused():
    class Noted(Event, message_name="names.Noted"):
        parent: str

        def journal_parents(self) -> tuple[str, ...]:
            return (self.parent,)

    assert parents_of(Noted(parent="user/42")) == ("user/42",)
    with pytest.raises(ValueError, match="journal_parents"):
        parents_of(Noted(parent="user/42\n"))


def test_an_endpoint_name_with_a_trailing_newline_is_refused():
    with pytest.raises(ConfigurationError, match="endpoint name"):
        Endpoint("sales\n", storage=MemoryStorage())


def test_a_schedule_name_with_a_trailing_newline_is_refused():
    with pytest.raises(ConfigurationError, match="schedule name"):
        Schedule("nightly\n", "0 * * * *", Ping())


@pytest.mark.parametrize("check", [
    check_prefix,
    lambda prefix: PostgresStorage("postgresql://nobody@127.0.0.1:1/none", table_prefix=prefix),
], ids=["database-transport", "postgres-storage"])
def test_a_table_prefix_with_a_trailing_newline_is_refused(check: Callable[[str], object]):
    with pytest.raises(ConfigurationError, match="prefix"):
        check("idembus\n")


class Tally(BaseModel):
    count: int = 0


def _handler(name: str) -> type[AggregateHandler[Tally]]:
    class Counter(AggregateHandler[Tally]):
        aggregate_type = name

        def aggregate_id(self, message: Ping) -> str:
            return message.account

        @handles
        def ping(self, message: Ping) -> None:
            self.state.count += 1

    return Counter


@pytest.mark.parametrize("name", [
    "Tally\nevent: names.Forged\ndata: {}",  # a line break: an event in the stream
    "Tally\n",
    "user/42",  # a Type/id reference of another aggregate
    "idembus_journal",  # idembus's own collections
    "idembus_inbox",
    "IDEMBUS_parked",
    "system.views",
    "Tal ly",
    "a$b",
    "x" * 101,
])
def test_an_aggregate_type_that_could_be_read_as_something_else_is_refused(name: str):
    with pytest.raises(HandlerDefinitionError, match="aggregate type"):
        HandlerTable([_handler(name)])


@pytest.mark.parametrize("name", ["Tally", "shop.Order-2", "_private", "x" * 100])
def test_ordinary_aggregate_types_are_accepted(name: str):
    assert HandlerTable([_handler(name)]).handlers
