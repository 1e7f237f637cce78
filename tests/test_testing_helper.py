"""idembus.testing.handle: unit-testing a handler without a broker."""

from __future__ import annotations

import datetime

import pytest
from pydantic import BaseModel

from idembus import Command, Event
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.testing import handle
from tests.support import Account, AccountHandler, Deposit, Deposited


class Ask(Command, message_name="th.Ask"):
    question: str


class Answer(Event, message_name="th.Answer"):
    text: str


class Escalate(Command, message_name="th.Escalate"):
    question: str


class Oracle(Handler):
    @handles
    def on(self, message: Ask) -> None:
        self.bus.reply(Answer(text=message.question.upper()))
        self.bus.send(Escalate(question=message.question))


def test_handle_reports_what_an_aggregate_handler_published_and_the_state_it_left():
    result = handle(AccountHandler, Deposit(account="a", amount=5))
    assert result.published == [Deposited(account="a", amount=5)]
    assert result.sent == [] and result.replied == []
    assert result.state == Account(balance=5, deposits=1)


def test_handle_starts_from_the_given_state():
    result = handle(AccountHandler, Deposit(account="a", amount=5),
                    state=Account(balance=10, deposits=3))
    assert result.state == Account(balance=15, deposits=4)


def test_handle_reports_replies_and_sends_with_their_destinations():
    result = handle(Oracle, Ask(question="why"), routes={Escalate: "humans"})
    assert result.replied == [Answer(text="WHY")]
    assert result.sent == [Escalate(question="why")]
    destinations = [e.destination for e in result.envelopes]
    assert destinations == ["test-sender", "humans"]


def test_handle_refuses_a_message_the_handler_does_not_handle_and_state_for_stateless():
    with pytest.raises(ValueError, match="does not handle th.Ask"):
        handle(AccountHandler, Ask(question="?"))
    with pytest.raises(ValueError, match="only for aggregate handlers"):
        handle(Oracle, Ask(question="?"), state=Account())


def test_handle_lets_the_handlers_exception_through():
    class Broken(Handler):
        @handles
        def on(self, message: Ask) -> None:
            raise LookupError("no oracle today")

    with pytest.raises(LookupError, match="no oracle today"):
        handle(Broken, Ask(question="?"))


class Remind(Command, message_name="th.Remind"):
    question: str


class GiveUp(Command, message_name="th.GiveUp"):
    question: str


class Pending(BaseModel):
    asked: int = 0


class Patient(AggregateHandler[Pending]):
    def aggregate_id(self, message: Ask) -> str:
        return message.question

    @handles
    def on(self, message: Ask) -> None:
        self.state.asked += 1
        self.bus.send(Escalate(question=message.question))
        self.bus.defer(Remind(question=message.question), datetime.timedelta(hours=1))
        self.request_timeout(GiveUp(question=message.question), datetime.timedelta(days=1))

    @handles
    def later(self, message: Remind | GiveUp) -> None:
        pass


def test_handle_tells_deferred_messages_and_timeouts_apart_from_those_sent_now():
    before = datetime.datetime.now(datetime.timezone.utc)
    result = handle(Patient, Ask(question="why"), routes={Escalate: "humans"})
    after = datetime.datetime.now(datetime.timezone.utc)
    # The command sent now is in `sent`; the deferred one and the timeout are not
    assert result.sent == [Escalate(question="why")]
    assert result.deferred == [Remind(question="why"), GiveUp(question="why")]
    remind, give_up = result.deferrals
    assert (remind.timeout, give_up.timeout) == (False, True)
    assert (remind.destination, give_up.destination) == ("test", "test")
    hour, day = datetime.timedelta(hours=1), datetime.timedelta(days=1)
    assert before + hour <= remind.deliver_at <= after + hour
    assert before + day <= give_up.deliver_at <= after + day
