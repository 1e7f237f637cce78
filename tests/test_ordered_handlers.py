"""Ordering declared by a handler (``class Ledger(AggregateHandler[Balance], ordered=True)``):
the commands it handles are sent with their key — its ``aggregate_id``, a field or a
callable — by every sender that knows the handler (the endpoint hosting it, its handlers'
sends, an endpoint told with ``ordering_from=``); a sender that does not know it sends
without a key, and the message is handled, counted as ``unordered`` and said once."""

from __future__ import annotations

import logging
import uuid

import pytest
from pydantic import BaseModel

from idembus import Command, Endpoint
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.handlers import AggregateHandler, Handler, HandlerDefinitionError, handles
from idembus.messages import partition_of
from idembus.routing import Router
from idembus.sending import Bus
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle


class Post(Command, message_name="test.ordered_handlers.Post"):
    account: str
    amount: int


class Batch(Command, message_name="test.ordered_handlers.Batch"):
    account: str
    count: int


class Flagged(Command, message_name="test.ordered_handlers.Flagged", ordered_by="tag"):
    account: str
    tag: str


class Balance(BaseModel):
    amounts: list[int] = []


class Ledger(AggregateHandler[Balance], ordered=True, partitions=8):
    """Appends each posted amount to its account: ordered by its aggregate id. Keeps the
    ordering headers each post arrived with (``arrived``), if given a list."""

    def __init__(self, arrived: list[tuple[str | None, str | None]] | None = None) -> None:
        self.arrived = arrived

    def aggregate_id(self, message: Post | Flagged) -> str:
        return message.account.lower()

    @handles
    def post(self, message: Post) -> None:
        self.state.amounts.append(message.amount)
        if self.arrived is not None:
            headers = self.context.headers
            self.arrived.append((headers.get(h.ORDERING_KEY), headers.get(h.PARTITION)))

    @handles
    def flagged(self, message: Flagged) -> None:
        self.state.amounts.append(-1)


class Poster(Handler):
    """Sends ``count`` posts of one account, in order, from a handler."""

    @handles
    def batch(self, message: Batch) -> None:
        for amount in range(message.count):
            self.bus.send(Post(account=message.account, amount=amount))


def _amounts(storage: MemoryStorage) -> dict[str, list[int]]:
    return {record.aggregate_id: list((record.state or {})["amounts"])
            for record in storage.records("Balance")}


def test_the_endpoint_hosting_the_handler_sends_its_commands_with_the_aggregate_id():
    endpoint = Endpoint(f"ledger-{uuid.uuid4().hex[:8]}", handlers=[Ledger])
    assert endpoint.router.order_of(Post(account="A-1", amount=1)) == ("a-1", 8)
    # The type's own declaration wins over the handler's
    assert endpoint.router.order_of(Flagged(account="A-1", tag="t")) == ("t", 16)
    assert endpoint.partitions == 16


@pytest.mark.timeout(60)
def test_sends_through_endpoint_bus_are_applied_in_order_by_four_threads():
    # Given the ledger on four threads (memory://: a thread per partition)
    storage = MemoryStorage()
    arrived: list[tuple[str | None, str | None]] = []
    endpoint = Endpoint(f"ledger-{uuid.uuid4().hex[:8]}", handlers=[Ledger(arrived)],
                        storage=storage, concurrency=4)
    with endpoint:
        # When posts of 10 accounts are sent interleaved through endpoint.bus
        for amount in range(12):
            for account in range(10):
                endpoint.bus.send(Post(account=f"acc{account}", amount=amount))
        wait_until_idle([endpoint], timeout=45)
    # Then each went with its account as its key, and each account saw them in order
    assert sorted(set(arrived)) == sorted(
        (f"acc{account}", str(partition_of(f"acc{account}", 8))) for account in range(10))
    assert _amounts(storage) == {f"acc{account}": list(range(12)) for account in range(10)}
    assert endpoint.counters.snapshot()["unordered"] == 0


@pytest.mark.timeout(60)
def test_a_handlers_sends_are_keyed_too_and_applied_in_order():
    # Given the ledger and a handler sending posts, in one endpoint of four threads
    storage = MemoryStorage()
    arrived: list[tuple[str | None, str | None]] = []
    endpoint = Endpoint(f"ledger-{uuid.uuid4().hex[:8]}", handlers=[Ledger(arrived), Poster],
                        storage=storage, concurrency=4)
    with endpoint:
        # When batches of posts are sent by the handler for three accounts
        for account in ("x", "y", "z"):
            endpoint.bus.send(Batch(account=account, count=15))
        wait_until_idle([endpoint], timeout=45)
    # Then every post the handler sent carried its account's key, and went in order
    assert len(arrived) == 45
    assert {key for key, _ in arrived} == {"x", "y", "z"}
    assert _amounts(storage) == {account: list(range(15)) for account in ("x", "y", "z")}


def test_another_endpoint_told_about_the_handler_sends_with_the_key():
    queue = f"ledger-{uuid.uuid4().hex[:8]}"
    informed = Endpoint("shop", routes={Post: queue}, ordering_from=[Ledger], send_only=True)
    uninformed = Endpoint("till", routes={Post: queue}, send_only=True)
    assert informed.router.order_of(Post(account="B", amount=1)) == ("b", 8)
    assert uninformed.router.order_of(Post(account="B", amount=1)) is None
    sent: list[Envelope] = []
    Bus("script", Router({Post: queue}, orderings=informed.router.orderings),
        sent.append).send(Post(account="B", amount=1))
    assert sent[0].headers[h.ORDERING_KEY] == "b"


@pytest.mark.timeout(60)
def test_a_foreign_sender_without_the_key_is_handled_counted_and_said_once(caplog):
    # Given the ledger, and a sender that only knows the route
    storage = MemoryStorage()
    endpoint = Endpoint(f"ledger-{uuid.uuid4().hex[:8]}", handlers=[Ledger], storage=storage)
    foreign = Bus("billing", Router({Post: endpoint.name}), endpoint.transport.dispatch)
    with endpoint, caplog.at_level(logging.WARNING, logger="idembus"):
        # When it sends three posts, one of them twice (the same message id)
        foreign.send(Post(account="c", amount=1), message_id="post-1")
        foreign.send(Post(account="c", amount=1), message_id="post-1")
        foreign.send(Post(account="c", amount=2))
        foreign.send(Post(account="d", amount=3))
        wait_until_idle([endpoint], timeout=30)
    # Then each is handled once (deduplicated), counted, and said once for the type
    assert _amounts(storage) == {"c": [1, 2], "d": [3]}
    counters = endpoint.counters.snapshot()
    assert counters["unordered"] == 4
    assert counters["duplicate"] == 1
    said = [r for r in caplog.records if "without its ordering key" in r.getMessage()]
    assert len(said) == 1
    assert "test.ordered_handlers.Post" in said[0].getMessage()
    assert "from billing" in said[0].getMessage()


def test_a_wrong_declaration_fails_when_the_class_or_the_endpoint_is_made():
    with pytest.raises(HandlerDefinitionError, match="only an AggregateHandler"):
        class Plain(Handler, ordered=True):
            pass
    with pytest.raises(HandlerDefinitionError, match="not both"):
        class Both(AggregateHandler[Balance], ordered=True, ordered_by="account"):
            pass
    with pytest.raises(HandlerDefinitionError, match="goes with ordered"):
        class Lonely(AggregateHandler[Balance], partitions=4):
            pass
    with pytest.raises(HandlerDefinitionError, match="must name a field"):
        class Number(Handler, ordered_by=3):
            pass

    class ByField(Handler, ordered_by="tag"):
        @handles
        def post(self, message: Post) -> None:
            pass

    with pytest.raises(HandlerDefinitionError, match="'tag' is not a field of"):
        Endpoint("fields", handlers=[ByField])


def test_a_handler_may_order_by_a_field_or_a_callable():
    class ByAccount(Handler, ordered_by="account"):
        @handles
        def post(self, message: Post) -> None:
            pass

    class ByParity(Handler, ordered_by=lambda message: message.amount % 2):
        @handles
        def post(self, message: Post) -> None:
            pass

    post = Post(account="E", amount=3)
    assert Endpoint("by-field", handlers=[ByAccount]).router.order_of(post) == ("E", 16)
    assert Endpoint("by-callable", handlers=[ByParity]).router.order_of(post) == ("1", 16)


def test_a_scenario_sends_with_the_key_its_endpoint_orders_by():
    from idembus.testing import Scenario

    arrived: list[tuple[str | None, str | None]] = []
    scenario = Scenario(handlers=[Ledger(arrived)])
    scenario.send(Post(account="F", amount=1))
    scenario.send(Flagged(account="F", tag="t"))  # ordered by its type: delivered too
    scenario.run()
    assert arrived == [("f", str(partition_of("f", 8)))]
    assert scenario.state(Balance, "f").amounts == [1, -1]
    assert scenario.endpoint().counters.snapshot()["unordered"] == 0
