"""An event that reaches no queue is normal (subscribers still to come): it is counted and
logged once per type at INFO, then at DEBUG; ``warn_unrouted_events=True`` brings back a
WARNING per type every 10 s."""

from __future__ import annotations

import logging
import uuid

import pytest

from idembus import Endpoint
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.storage.memory import MemoryStorage


def published(message_type: str) -> Envelope:
    return Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: message_type}, "{}",
                    None)


def unrouted_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if "reached no queue" in r.getMessage()]


def test_an_unrouted_event_is_logged_once_per_type_at_info_then_at_debug(caplog):
    endpoint = Endpoint("publisher", storage=MemoryStorage())
    with caplog.at_level(logging.DEBUG, logger="idembus.runtime.endpoint"):
        for message_type in ("shop.OrderPlaced", "shop.OrderPlaced", "shop.OrderPaid",
                             "shop.OrderPlaced"):
            endpoint.unrouted(published(message_type))

    levels = [(level, text.split()[1]) for level, text in unrouted_lines(caplog)]
    assert levels == [(logging.INFO, "shop.OrderPlaced"), (logging.DEBUG, "shop.OrderPlaced"),
                      (logging.INFO, "shop.OrderPaid"), (logging.DEBUG, "shop.OrderPlaced")]
    assert "further ones of this type are logged at DEBUG" in unrouted_lines(caplog)[0][1]
    assert endpoint.counters["unrouted"] == 4  # the signal and the counter see every one


def test_warn_unrouted_events_logs_a_warning_per_type_every_10_seconds(caplog):
    endpoint = Endpoint("publisher", storage=MemoryStorage(), warn_unrouted_events=True)
    with caplog.at_level(logging.DEBUG, logger="idembus.runtime.endpoint"):
        for message_type in ("shop.OrderPlaced", "shop.OrderPlaced", "shop.OrderPaid"):
            endpoint.unrouted(published(message_type))
    assert [(level, text.split()[1]) for level, text in unrouted_lines(caplog)] == [
        (logging.WARNING, "shop.OrderPlaced"), (logging.WARNING, "shop.OrderPaid")]
    assert endpoint.counters["unrouted"] == 3
