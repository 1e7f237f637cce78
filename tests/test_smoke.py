from tests.support import Account, AccountHandler, Deposit, Ledger, SignalCounter


def test_a_deposit_flows_from_account_to_ledger(make_endpoint):
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    downstream = make_endpoint("ledger", handlers=[ledger])
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    accounts.bus.send(Deposit(account="a", amount=5))

    assert recorded.wait_for(1)
    record = accounts.storage.load("Account", "a")
    assert Account.model_validate(record.state).balance == 5
    assert [entry[1:] for entry in ledger.entries] == [("a", 5)]
