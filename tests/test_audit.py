"""Endpoints with the Audit middleware keep what happened to each message in their storage."""

from __future__ import annotations

from idembus import RetryPolicy
from idembus.observability.audit import Audit
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from tests.support import AccountHandler, Deposit, SignalCounter


def test_an_audited_endpoint_records_handled_duplicate_and_dead_lettered_messages(
    make_endpoint,
):
    storage = MemoryStorage()
    service = make_endpoint("audited", handlers=[AccountHandler], storage=storage,
                            middleware=[Audit()],
                            recoverability=Recoverability(
                                retries=RetryPolicy(immediate_retries=0, delayed=())))
    handled = SignalCounter(service, "handled")
    duplicate = SignalCounter(service, "duplicate")
    service.start()

    first = service.bus.send(Deposit(account="a", amount=1))
    service.bus.send(Deposit(account="a", amount=1), message_id=first)
    assert handled.wait_for(1) and duplicate.wait_for(1)
    # The signals come from inside the handler stage; the audit record is written when the
    # delivery's stages end: wait until nothing is in flight.
    wait_until_idle([service])
    assert service.audit is not None
    service.audit.flush()

    records = sorted(storage.read_audit(), key=lambda r: r.outcome)
    assert [(r.outcome, r.message_id, r.handler) for r in records] == [
        ("duplicate", first, "AccountHandler"), ("handled", first, "AccountHandler")]
    assert all(r.time_sent is not None and r.recorded_at >= r.time_sent for r in records)
    assert all(r.message_type == "test.Deposit" for r in records)


def test_endpoints_keep_no_audit_unless_asked(make_endpoint):
    storage = MemoryStorage()
    service = make_endpoint("quiet", handlers=[AccountHandler], storage=storage)
    handled = SignalCounter(service, "handled")
    service.start()
    service.bus.send(Deposit(account="a", amount=1))
    assert handled.wait_for(1)
    assert service.audit is None and list(storage.read_audit()) == []
