"""The ordering sample's history, read from the stores and checked message by message.

:mod:`samples.ordering.audit` counts (orders placed, billed, shipped, charges); this module
decides. It reads every commit the three endpoints stored — which message each handled
(its id, in the commit's key), which messages it sent (their ids) and when it was
committed — and the payment gateway's charges, and checks that the commits make one
history in which every message took effect exactly once, in causal order:

* **duplicate**: no message handled by two commits at one endpoint, and no outgoing id
  stored by two commits;
* **unsent**: every commit handles a message that an upstream commit sent (Sales: a
  PlaceOrder of the driver's, when its ids are given), and every order placed is one that
  was ordered;
* **lost**: every message a commit sent is handled by the endpoint that subscribes to it
  (Sales' OrderPlaced by Billing, Billing's OrderBilled by Shipping), every ordered order
  placed, every PlaceOrder sent handled;
* **order**: a commit is not older than the commit that sent the message it handled;
* **misrouted**: a Shipment handles the OrderBilled of its own order;
* **charge**: each billed order charged once, no charge without a billing, each shipment
  carries its order's charge.

::

    found = check_history(sales=..., billing=..., shipping=..., charges=gateway.charges,
                          order_ids=order_ids)
    found.ok, found.counts(), found.described()
"""

from __future__ import annotations

import datetime
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from idembus.storage.base import INBOX, AggregateRecord, ProcessedMessage, Storage
from samples.ordering.billing import Charge

#: The kinds of violations, in the order they are reported.
KINDS = ("duplicate", "unsent", "lost", "order", "misrouted", "charge")
#: How many processed entries of one aggregate are read (an order has one of each).
ENTRIES = 1000
#: The endpoints in the order messages flow through them, with the aggregate type their
#: commits are stored under; each one's outgoing messages are handled by the next.
FLOW = (("sales", "Order"), ("billing", INBOX), ("shipping", "Shipment"))


@dataclass(frozen=True)
class Commit:
    """One stored commit: the message an endpoint's handler took effect for, and what it
    sent."""

    endpoint: str
    aggregate_id: str
    #: The handler-scoped key (``Handler/message id``).
    key: str
    outgoing_ids: tuple[str, ...]
    at: datetime.datetime | None

    @property
    def incoming_id(self) -> str:
        """The id of the message this commit handled."""
        return self.key.split("/", 1)[-1]

    def __str__(self) -> str:
        at = self.at.isoformat(timespec="microseconds") if self.at else "unknown time"
        return f"{self.endpoint} {self.aggregate_id!r} at {at}"


@dataclass(frozen=True)
class Violation:
    """One thing the history must not hold: its kind (:data:`KINDS`) and what it is."""

    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"


@dataclass(frozen=True)
class HistoryCheck:
    """What :func:`check_history` found."""

    #: Commits read, per endpoint.
    commits: Mapping[str, int]
    violations: tuple[Violation, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.violations

    def counts(self) -> dict[str, int]:
        """Violations by kind, the kinds that occur only, in the order of :data:`KINDS`."""
        found = Counter(violation.kind for violation in self.violations)
        return {kind: found[kind] for kind in KINDS if found[kind]}

    def described(self, first: int = 10) -> list[str]:
        """The counts and the first ``first`` violations in words; empty when ok."""
        if self.ok:
            return []
        counts = ", ".join(f"{kind} {count}" for kind, count in self.counts().items())
        lines = [f"{len(self.violations)} history violations ({counts})"]
        lines += [f"  {violation}" for violation in self.violations[:first]]
        if len(self.violations) > first:
            lines.append(f"  ... and {len(self.violations) - first} more")
        return lines


def read_commits(storage: Storage, endpoint: str, aggregate_type: str) -> list[Commit]:
    """Every commit ``storage`` keeps for ``aggregate_type``, with its processed entries
    (PostgreSQL's ``records`` has none: read through ``history``)."""
    commits = []
    for record in storage.records(aggregate_type):
        for key, entry in _entries(storage, record):
            commits.append(Commit(endpoint, record.aggregate_id, key, tuple(entry.outgoing_ids),
                                  entry.at))
    return commits


def _entries(storage: Storage,
             record: AggregateRecord) -> Iterable[tuple[str, ProcessedMessage]]:
    """A record's processed entries, read again through ``history`` where ``records``
    leaves them out."""
    if record.processed or not record.exists:
        return record.processed.items()
    return storage.history(record.aggregate_type, record.aggregate_id,
                           entries=ENTRIES).processed.items()


def check_history(
    *,
    sales: Storage,
    billing: Storage,
    shipping: Storage,
    charges: Iterable[Charge],
    order_ids: Collection[str],
    commands: Mapping[str, str] | None = None,
) -> HistoryCheck:
    """Read the three endpoints' stores and check their history (the module docstring
    lists what). ``commands``: the PlaceOrder message ids that were sent, each with its
    order id; without it any PlaceOrder id is taken as sent."""
    storages = {"sales": sales, "billing": billing, "shipping": shipping}
    commits = {endpoint: read_commits(storages[endpoint], endpoint, aggregate_type)
               for endpoint, aggregate_type in FLOW}
    shipments = {record.aggregate_id: dict(record.state or {})
                 for record in shipping.records("Shipment")}
    violations = [
        *_duplicates(commits),
        *_placements(commits["sales"], order_ids, commands),
        *_chain(commits),
        *_charges(commits, list(charges), shipments),
    ]
    order = {kind: position for position, kind in enumerate(KINDS)}
    violations.sort(key=lambda violation: order[violation.kind])
    return HistoryCheck({endpoint: len(found) for endpoint, found in commits.items()},
                        tuple(violations))


def _duplicates(commits: Mapping[str, list[Commit]]) -> Iterator[Violation]:
    """One message handled twice at an endpoint; one outgoing id stored by two commits."""
    for endpoint, found in commits.items():
        by_incoming: dict[str, list[Commit]] = defaultdict(list)
        for commit in found:
            by_incoming[commit.incoming_id].append(commit)
        for incoming_id, same in by_incoming.items():
            if len(same) > 1:
                yield Violation("duplicate", f"{endpoint} handled message {incoming_id} "
                                f"{len(same)} times: {_listed(same)}")
    senders: dict[str, list[Commit]] = defaultdict(list)
    for found in commits.values():
        for commit in found:
            for outgoing_id in commit.outgoing_ids:
                senders[outgoing_id].append(commit)
    for outgoing_id, same in senders.items():
        if len(same) > 1:
            yield Violation("duplicate", f"message {outgoing_id} was sent by {len(same)} "
                            f"commits: {_listed(same)}")


def _placements(placed: list[Commit], order_ids: Collection[str],
                commands: Mapping[str, str] | None) -> Iterator[Violation]:
    """Each ordered order placed; each placement of an ordered order, by a PlaceOrder that
    was sent for it."""
    expected = set(order_ids)
    orders = {commit.aggregate_id for commit in placed}
    for commit in placed:
        if commit.aggregate_id not in expected:
            yield Violation("unsent", f"order {commit.aggregate_id!r} nobody ordered was "
                            f"placed ({commit})")
        elif commands is not None and commit.incoming_id not in commands:
            yield Violation("unsent", f"{commit} handled PlaceOrder {commit.incoming_id}, "
                            "which the driver never sent")
        elif commands is not None and commands[commit.incoming_id] != commit.aggregate_id:
            yield Violation("misrouted", f"{commit} handled the PlaceOrder of "
                            f"{commands[commit.incoming_id]!r}")
    for order_id in sorted(expected - orders):
        yield Violation("lost", f"order {order_id!r} was never placed")
    if commands is not None:
        handled = {commit.incoming_id for commit in placed}
        for message_id, order_id in sorted(commands.items()):
            if message_id not in handled and order_id in orders:
                yield Violation("lost", f"PlaceOrder {message_id} of {order_id!r} was "
                                "never handled (its order was placed by another)")


def _chain(commits: Mapping[str, list[Commit]]) -> Iterator[Violation]:
    """Each endpoint's commits handle what the one before it sent, after it was sent; each
    message sent is handled downstream; a Shipment ships its own order."""
    placed_by = {out: commit for commit in commits["sales"] for out in commit.outgoing_ids}
    for (upstream, _), (downstream, _) in zip(FLOW, FLOW[1:], strict=False):
        sent_by = {out: commit for commit in commits[upstream] for out in commit.outgoing_ids}
        handled = {commit.incoming_id for commit in commits[downstream]}
        for commit in commits[downstream]:
            sender = sent_by.get(commit.incoming_id)
            if sender is None:
                yield Violation("unsent", f"{commit} handled message {commit.incoming_id}, "
                                f"which no {upstream} commit sent")
                continue
            if sender.at is not None and commit.at is not None and commit.at < sender.at:
                yield Violation("order", f"{commit} handled message {commit.incoming_id} "
                                f"before it was committed, by {sender}")
        for out, sender in sent_by.items():
            if out not in handled:
                yield Violation("lost", f"message {out} sent by {sender} was never handled "
                                f"by {downstream}")
    billed_by = {out: commit for commit in commits["billing"] for out in commit.outgoing_ids}
    for commit in commits["shipping"]:
        billing = billed_by.get(commit.incoming_id)
        placement = placed_by.get(billing.incoming_id) if billing is not None else None
        if placement is not None and placement.aggregate_id != commit.aggregate_id:
            yield Violation("misrouted", f"{commit} shipped for the billing of order "
                            f"{placement.aggregate_id!r}")


def _charges(commits: Mapping[str, list[Commit]], charges: list[Charge],
             shipments: Mapping[str, Mapping[str, object]]) -> Iterator[Violation]:
    """Each billed order charged once, nothing charged unbilled, each shipment carrying its
    order's charge."""
    placed_by = {out: commit for commit in commits["sales"] for out in commit.outgoing_ids}
    billed = Counter(placed_by[commit.incoming_id].aggregate_id
                     for commit in commits["billing"] if commit.incoming_id in placed_by)
    by_order: dict[str, list[Charge]] = defaultdict(list)
    for charge in charges:
        by_order[charge.order_id].append(charge)
    for order_id in sorted(set(billed) | set(by_order)):
        made, billings = by_order.get(order_id, []), billed.get(order_id, 0)
        if len(made) != min(billings, 1):
            yield Violation("charge", f"order {order_id!r} was charged {len(made)} times "
                            f"for {billings} billings")
    for order_id, state in sorted(shipments.items()):
        made = by_order.get(order_id, [])
        if state.get("shipped") and state.get("charge_id") not in {c.charge_id for c in made}:
            yield Violation("charge", f"shipment {order_id!r} carries charge "
                            f"{state.get('charge_id')!r}, not one made for its order")


def _listed(commits: list[Commit]) -> str:
    return "; ".join(str(commit) for commit in commits)
