"""``Endpoint(defer_fresh_redispatch=...)``: a duplicate that finds its entry committed
moments ago and not yet marked dispatched leaves the sending to the committer or, when the
committer died, to the outbox — fewer copies downstream, never a lost message."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from idembus import Endpoint
from idembus.errors import ConfigurationError
from idembus.policies import OutboxPolicy
from idembus.testing import wait_until_idle
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from tests.support import AccountHandler, Deposit, Ledger, SignalCounter


class CrashOnceAfterCommit(FaultInjector):
    """The first message dies after its commit, before anything is sent."""

    def __init__(self) -> None:
        self.crashed = False

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if point is CrashPoint.AFTER_COMMIT and not self.crashed:
            self.crashed = True
            raise SimulatedCrash(f"simulated crash after the commit of {message_id}")


@pytest.mark.parametrize("defer", [0.0, 60.0])
def test_a_redelivery_after_a_crash_sends_each_message_once_either_way(
    make_endpoint: Callable[..., Endpoint], defer: float,
) -> None:
    # Given an endpoint that dies once after a commit, and a downstream ledger
    ledger = Ledger()
    downstream = make_endpoint("ledger", handlers=[ledger])
    accounts = make_endpoint("accounts", handlers=[AccountHandler],
                    middleware=[CrashOnceAfterCommit()],
                    outbox=OutboxPolicy(defer_fresh_redispatch=defer, grace=0.2))
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a deposit arrives, its commit lands, the process "dies", the broker redelivers
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then the event reaches the ledger exactly once: re-sent by the duplicate at once
    # (defer 0), or left to the outbox, which sends it after its grace (defer 60 s)
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert [entry[1:] for entry in ledger.entries] == [("a", 5)]
    assert downstream.counters["duplicate"] == 0
    assert accounts.counters["duplicate"] == 1
    assert accounts.counters["redispatched"] == (0 if defer else 1)
    assert accounts.counters["left_to_outbox"] == (1 if defer else 0)


def test_deferring_fresh_redispatches_needs_the_outbox() -> None:
    with pytest.raises(ConfigurationError, match="outbox"):
        Endpoint("sales", outbox=OutboxPolicy(defer_fresh_redispatch=5.0, run=False))
    with pytest.raises(ConfigurationError, match="0 or more"):
        Endpoint("sales", outbox=OutboxPolicy(defer_fresh_redispatch=-1.0))
