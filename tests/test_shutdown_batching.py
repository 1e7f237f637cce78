"""Exit never waits without bound for deferred writes: a batched write that blocks (an audit
insert into a PostgreSQL without a statement timeout) delays flush() and close() by their
timeouts at most, and what was not written is logged at ERROR with its count."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from idembus import Endpoint
from idembus.observability.audit import Audit
from idembus.storage.base import AuditRecord
from idembus.storage.memory import MemoryStorage
from idembus.storage.write_behind import CLOSE_TIMEOUT, Batcher
from tests.support import AccountHandler, Deposit, SignalCounter

#: Slack for a loaded machine on top of the timeout under test.
SLACK = 5.0


class BlockedWriter:
    """A write function that blocks until released; tells when a write has begun."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.written: list[int] = []

    def write(self, batch: list[int]) -> None:
        self.entered.set()
        self.release.wait()
        self.written.extend(batch)


@pytest.fixture
def writer() -> Iterator[BlockedWriter]:
    blocked = BlockedWriter()
    yield blocked
    blocked.release.set()  # let the writer thread, left behind, end


def blocked_batcher(writer: BlockedWriter) -> Batcher[int]:
    """A batcher whose first write of 3 items is blocked, with 2 more items pending."""
    batcher: Batcher[int] = Batcher(writer.write, name="audit", interval=0.01)
    for item in range(3):
        batcher.add(item)
    assert writer.entered.wait(10)
    batcher.add(3)
    batcher.add(4)
    return batcher


def test_close_gives_up_after_its_timeout_when_a_write_is_blocked_and_counts_what_was_lost(
    writer: BlockedWriter, caplog: pytest.LogCaptureFixture,
) -> None:
    batcher = blocked_batcher(writer)

    started = time.monotonic()
    closed = batcher.close(timeout=0.1)

    assert closed is False
    assert time.monotonic() - started < 0.1 + SLACK
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("audit: 5 item(s) not written" in line for line in errors), errors


def test_flush_gives_up_after_its_timeout_when_a_write_is_blocked(
    writer: BlockedWriter, caplog: pytest.LogCaptureFixture,
) -> None:
    batcher = blocked_batcher(writer)

    assert batcher.flush(timeout=0.1) is False
    assert any("audit: 5 item(s) not written" in r.getMessage() for r in caplog.records
               if r.levelno == logging.ERROR)

    # Once the write is released, everything goes through and close() says so
    writer.release.set()
    assert batcher.flush(timeout=10) is True
    assert batcher.close(timeout=10) is True
    assert sorted(writer.written) == [0, 1, 2, 3, 4]


class BlockedAudit(MemoryStorage):
    """A storage whose audit writes block until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write_audit(self, records: Sequence[AuditRecord]) -> None:
        self.entered.set()
        self.release.wait()
        super().write_audit(records)


def test_an_endpoint_whose_audit_writes_block_still_closes_in_bounded_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given an audited endpoint whose audit write is blocked
    storage = BlockedAudit()
    endpoint = Endpoint("audited-close", storage=storage, handlers=[AccountHandler],
                        middleware=[Audit()])
    handled = SignalCounter(endpoint, "handled")
    try:
        endpoint.start()
        endpoint.bus.send(Deposit(account="a", amount=1))
        assert handled.wait_for(1)
        assert storage.entered.wait(10)

        # When it is closed (in a thread: a hang fails the test instead of stopping it)
        closer = threading.Thread(target=endpoint.close, daemon=True)
        closer.start()
        closer.join(CLOSE_TIMEOUT + SLACK)

        # Then close() returned, and said what the audit trail lost
        assert not closer.is_alive(), "Endpoint.close() waited on the blocked audit write"
        assert any("not written" in r.getMessage() and r.levelno == logging.ERROR
                   for r in caplog.records)
    finally:
        storage.release.set()
