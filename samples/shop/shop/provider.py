"""A fake payment provider, standing in for Stripe or Adyen.

Like a real one it lives outside the shop's database, so a charge cannot be committed
together with the payments service's own records: if a worker dies after charging and
before committing, the message is handled again and the card would be charged again. What
prevents it is the **idempotency key**: a second charge with a key the provider has seen
charges nothing and answers with the first charge.

It keeps its charges in a SQLite file (``SHOP_PROVIDER_DB``, default
``shop-provider.sqlite3`` in the working directory) so that every worker process of the
payments service sees the same ones. Test card numbers:

``4000000000000002``  declined: :class:`CardDeclined`, the order is cancelled
``4000000000000259``  blocked by the provider's risk rules until someone approves it
                      (``python -m shop.provider approve 4000000000000259``):
                      :class:`CardBlocked`, the message goes to the error queue
anything else         charged
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass

DECLINED_CARD = "4000000000000002"
BLOCKED_CARD = "4000000000000259"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    idempotency_key TEXT PRIMARY KEY,
    charge_id TEXT NOT NULL,
    card_number TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    description TEXT NOT NULL,
    requests INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS approved_cards (card_number TEXT PRIMARY KEY);
"""


class CardDeclined(Exception):
    """The bank said no: an answer for the customer, not an error of the shop."""


class CardBlocked(Exception):
    """The provider's risk rules hold the card until a person approves it."""


@dataclass(frozen=True)
class Charge:
    """One charge the provider made."""

    charge_id: str
    card_number: str
    amount_cents: int
    description: str
    #: How many requests asked for this charge (more than 1: replays of one key).
    requests: int = 1


class FakePaymentProvider:
    """The provider's API: :meth:`charge` once per idempotency key."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or os.environ.get("SHOP_PROVIDER_DB", "shop-provider.sqlite3")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            db.executescript(_SCHEMA)
            db.execute("BEGIN IMMEDIATE")  # one writer at a time, across processes
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def charge(self, card_number: str, amount_cents: int, *, description: str,
               idempotency_key: str) -> Charge:
        """Charge ``amount_cents`` to the card, once per ``idempotency_key``: a request with
        a key seen before charges nothing and returns the first charge. Raises
        :class:`CardDeclined` or :class:`CardBlocked`."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT charge_id, card_number, amount_cents, description FROM charges "
                "WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
            if row is not None:
                db.execute("UPDATE charges SET requests = requests + 1 "
                           "WHERE idempotency_key = ?", (idempotency_key,))
                return Charge(*row)
            if card_number == DECLINED_CARD:
                raise CardDeclined(f"card ending {card_number[-4:]} was declined")
            approved = db.execute("SELECT 1 FROM approved_cards WHERE card_number = ?",
                                  (card_number,)).fetchone()
            if card_number == BLOCKED_CARD and approved is None:
                raise CardBlocked(f"card ending {card_number[-4:]} is blocked by the risk "
                                  "rules until it is approved")
            charge = Charge(f"ch_{uuid.uuid4().hex[:16]}", card_number, amount_cents,
                            description)
            db.execute(
                "INSERT INTO charges (idempotency_key, charge_id, card_number, amount_cents,"
                " description) VALUES (?, ?, ?, ?, ?)",
                (idempotency_key, charge.charge_id, card_number, amount_cents, description))
            return charge

    def approve(self, card_number: str) -> None:
        """Lift the risk rules' block on a card (what a person does in the provider's
        console)."""
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO approved_cards VALUES (?)", (card_number,))

    def charges(self) -> list[Charge]:
        """Every charge made, oldest first."""
        with self._transaction() as db:
            rows = db.execute("SELECT charge_id, card_number, amount_cents, description, "
                              "requests FROM charges ORDER BY rowid").fetchall()
        return [Charge(*row) for row in rows]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shop.provider charges`` lists the charges; ``approve CARD`` approves a
    blocked card."""
    parser = argparse.ArgumentParser(prog="python -m shop.provider",
                                     description="The fake payment provider's console.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("charges", help="list the charges made")
    approve = commands.add_parser("approve", help="approve a card the risk rules block")
    approve.add_argument("card_number")
    args = parser.parse_args(argv)
    provider = FakePaymentProvider()
    if args.command == "approve":
        provider.approve(args.card_number)
        print(f"card ending {args.card_number[-4:]} approved")
        return 0
    for charge in provider.charges():
        print(f"{charge.charge_id}  {charge.amount_cents:>8}  {charge.description}  "
              f"(requested {charge.requests}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
