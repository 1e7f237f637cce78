"""Everything wrong with a handler class is reported when the endpoint is created."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from idembus import Command, ConfigurationError, Endpoint, Event, Middleware, RetryPolicy
from idembus.handlers import AggregateHandler, Handler, HandlerDefinitionError, handles
from idembus.handlers.registration import HandlerTable
from idembus.pipeline import HandlerCall
from idembus.runtime.recoverability.policy import Recovery
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle


class Open(Command, message_name="hd.Open"):
    account: str


class Close(Command, message_name="hd.Close"):
    account: str


class Opened(Event, message_name="hd.Opened"):
    account: str


class AccountState(BaseModel):
    open: bool = False


class Accounts(AggregateHandler[AccountState]):
    def aggregate_id(self, message: Open | Close) -> str:
        return message.account

    @handles
    def open(self, message: Open | Close) -> None:
        self.state.open = isinstance(message, Open)


def table(*handlers):
    return HandlerTable(handlers)


def test_one_method_annotated_with_a_union_handles_each_member():
    bindings = table(Accounts)
    assert {b.message_type for b in bindings.bindings_for(Open) + bindings.bindings_for(Close)} == {
        Open, Close}
    assert bindings.bindings_for(Open)[0].aggregate_type == "AccountState"


def test_explicit_types_in_handles_take_the_place_of_annotations():
    class Audit(Handler):
        @handles(Open, Opened)
        def note(self, message):  # no annotation needed
            pass

    assert {b.message_type for b in table(Audit).bindings_for(Open)} == {Open}
    assert table(Audit).bindings_for(Opened)[0].handler_name == "Audit"


def test_each_binding_keeps_the_name_of_its_own_handler_class():
    class Audit(Handler):
        @handles(Open)
        def note(self, message):
            pass

    class Ledger(Handler):
        handler_name = "ledger-v2"

        @handles(Open)
        def note(self, message):
            pass

    bindings = table(Audit, Ledger).bindings_for(Open)
    for _ in range(2):  # asked again: the kept name is still each one's own
        assert [binding.handler_name for binding in bindings] == ["Audit", "ledger-v2"]


class NotAMessage(BaseModel):
    x: int


def test_a_handler_for_something_that_is_not_a_message_type_fails_with_the_fix():
    class Wrong(Handler):
        @handles
        def on(self, message: NotAMessage) -> None:
            pass

    with pytest.raises(HandlerDefinitionError,
                       match="not a message type: derive it from bus.Command"):
        table(Wrong)


def test_a_handler_without_any_handles_method_fails():
    class Idle(Handler):
        def on(self, message: Open) -> None:
            pass

    with pytest.raises(HandlerDefinitionError, match="handles nothing: decorate"):
        table(Idle)


def test_an_unannotated_handles_method_asks_for_an_annotation():
    class Vague(Handler):
        @handles
        def on(self, message):
            pass

    with pytest.raises(HandlerDefinitionError, match="annotate its message parameter"):
        table(Vague)


def test_two_methods_of_one_class_handling_one_type_fail():
    class Twice(Handler):
        @handles
        def first(self, message: Open) -> None:
            pass

        @handles
        def second(self, message: Open) -> None:
            pass

    with pytest.raises(HandlerDefinitionError, match="both handle hd.Open"):
        table(Twice)


def test_two_aggregate_handlers_of_one_aggregate_type_claiming_one_message_type_fail():
    class MoreAccounts(AggregateHandler[AccountState]):
        handler_name = "MoreAccounts"

        def aggregate_id(self, message: Open) -> str:
            return message.account

        @handles
        def also_open(self, message: Open) -> None:
            pass

    with pytest.raises(HandlerDefinitionError,
                       match="both change aggregate 'AccountState' on hd.Open"):
        table(Accounts, MoreAccounts)


def test_two_handlers_of_different_aggregates_may_handle_one_message_type():
    class Other(BaseModel):
        seen: int = 0

    class Counting(AggregateHandler[Other]):
        def aggregate_id(self, message: Open) -> str:
            return message.account

        @handles
        def count(self, message: Open) -> None:
            self.state.seen += 1

    assert len(table(Accounts, Counting).bindings_for(Open)) == 2


def test_two_handlers_with_one_name_fail_because_the_name_scopes_deduplication():
    class First(Handler):
        handler_name = "same"

        @handles
        def on(self, message: Open) -> None:
            pass

    class Second(Handler):
        handler_name = "same"

        @handles
        def on(self, message: Close) -> None:
            pass

    with pytest.raises(HandlerDefinitionError, match="two handlers are named 'same'"):
        table(First, Second)


def test_an_aggregate_handler_without_a_state_type_fails():
    class Stateless(AggregateHandler):  # type: ignore[type-arg]
        def aggregate_id(self, message: Open) -> str:
            return message.account

        @handles
        def on(self, message: Open) -> None:
            pass

    expected = r"needs its state type: class Stateless\(AggregateHandler\[MyState\]\)"
    with pytest.raises(HandlerDefinitionError, match=expected):
        table(Stateless)


def test_an_aggregate_handler_without_aggregate_id_fails():
    class Anonymous(AggregateHandler[AccountState]):
        @handles
        def on(self, message: Open) -> None:
            pass

    with pytest.raises(HandlerDefinitionError, match="must implement aggregate_id"):
        table(Anonymous)


def test_a_state_with_required_fields_needs_new_state():
    class Strict(BaseModel):
        owner: str

    class NeedsOwner(AggregateHandler[Strict]):
        def aggregate_id(self, message: Open) -> str:
            return message.account

        @handles
        def on(self, message: Open) -> None:
            pass

    with pytest.raises(HandlerDefinitionError, match=r"required fields \['owner'\].*new_state"):
        table(NeedsOwner)

    class GivesOwner(NeedsOwner):
        def new_state(self, aggregate_id: str, message: Open) -> Strict:
            return Strict(owner=aggregate_id)

    assert table(GivesOwner).bindings_for(Open)


def test_a_handler_class_that_needs_arguments_asks_for_an_instance():
    class WithGateway(Handler):
        def __init__(self, gateway: object) -> None:
            self.gateway = gateway

        @handles
        def on(self, message: Open) -> None:
            pass

    with pytest.raises(HandlerDefinitionError, match=r"pass an instance instead"):
        table(WithGateway)
    assert table(WithGateway(object())).bindings_for(Open)


def test_something_that_is_not_a_handler_fails():
    with pytest.raises(HandlerDefinitionError, match="is not a handler"):
        table(object)
    with pytest.raises(HandlerDefinitionError, match="is not a handler"):
        table(lambda message: None)


def test_the_endpoint_reports_handler_errors_when_it_is_created():
    class Idle(Handler):
        pass

    with pytest.raises(HandlerDefinitionError, match="handles nothing"):
        Endpoint("accounts", storage=MemoryStorage(), handlers=[Idle])


# -- handler options: the class attributes a policy of the endpoint reads ------------------


class TimeLimit(Middleware):
    """A policy reading a handler option it declares (this test's own)."""

    handler_options = ("time_limit_seconds",)

    def __init__(self) -> None:
        self.limits: list[float] = []

    def before_handler(self, call: HandlerCall) -> None:
        self.limits.append(self.option(call.handler_object, "time_limit_seconds", 60.0))


class Patient(Handler):
    time_limit_seconds = 30.0

    @handles
    def on(self, message: Open) -> None:
        pass


def test_a_misspelled_handler_option_fails_at_construction_with_the_likely_name():
    # Before: nothing read ``retry_polcy``; the handler silently kept the endpoint's retries.
    class Misspelled(Handler):
        retry_polcy = RetryPolicy(immediate_retries=0)

        @handles
        def on(self, message: Open) -> None:
            pass

    with pytest.raises(ConfigurationError, match=r"'retry_polcy'.*did you mean 'retry_policy'"
                                                 r"\? Did you forget to add a middleware\?"):
        Endpoint("opts", handlers=[Misspelled])


def test_an_option_whose_middleware_is_missing_fails_and_names_the_middleware():
    # Before: the endpoint never looked at options no policy of its own reads.
    with pytest.raises(ConfigurationError, match="'time_limit_seconds', which TimeLimit reads,"
                                                 ".*Did you forget to add a middleware"):
        Endpoint("opts", handlers=[Patient])
    # With the middleware that reads it, the same handler is fine, and its option is read
    limit = TimeLimit()
    with Endpoint("opts", handlers=[Patient], middleware=[limit]) as endpoint:
        endpoint.bus.send(Open(account="a"))
        wait_until_idle([endpoint])
    assert limit.limits == [30.0]


def test_a_handler_s_own_attributes_and_methods_are_not_taken_for_options():
    class Own(Handler):
        greeting = "hello"
        retries_seen = 0

        def retry_policies(self) -> list[str]:  # a method close to an option's name
            return []

        @handles
        def on(self, message: Open) -> None:
            pass

    with Endpoint("opts", handlers=[Own, Accounts]):
        pass


def test_a_policy_reads_only_the_handler_options_it_declares():
    class Sneaky(Middleware):
        handler_options = ("time_limit_seconds",)

    assert Sneaky().option(Patient(), "time_limit_seconds") == 30.0
    assert Sneaky().option(Accounts(), "time_limit_seconds", 5.0) == 5.0
    with pytest.raises(TypeError, match="without declaring it"):
        Sneaky().option(Patient(), "retry_policy")
    assert "retry_policy" in Recovery.handler_options
