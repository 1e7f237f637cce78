"""The ordering sample with Sales' events served as a Server-Sent Events stream.

    python -m samples.stream                 # memory:// and MemoryStorage, in one process

Sales journals the OrderPlaced events it publishes (``Endpoint(journal=True)``, with
simulated crashes and duplicate commands as in ``samples.ordering``) and a gateway serves
its journal. Three clients read it over HTTP with the standard library:

* ``follower`` starts from an empty journal and is cut off every few dozen events; each
  time it reconnects with the last id it received;
* ``customer`` follows one customer only (``parents=customer/customer-3``);
* ``replica`` arrives when half the orders are in and asks for full replication
  (``Last-Event-ID: 0``): the Order states, then ``live``, then the events since.

It prints one line and exits non-zero unless the follower and the customer client got every
order of theirs exactly once and the replica every order (a replica may see an order both
as a state and as an event: ``replica_overlap``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from idembus.gateway import Gateway
from idembus.testing import wait_until_idle
from idembus.testing.faults import RandomCrashes
from samples.ordering.messages import PlaceOrder
from samples.ordering.system import build, order_commands
from samples.stream.client import StreamEvent, stream

FOLLOWED_CUSTOMER = "customer-3"


@dataclass
class Reader:
    """What one client received: order ids in arrival order, and how often it connected."""

    orders: list[str] = field(default_factory=list)
    states: int = 0
    connections: int = 0
    error: str = ""
    #: Set at the first ``live`` event: the client is following the journal.
    live: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def follow(host: str, port: int, reader: Reader, expected: int, *, path: str = "/",
           cut_every: int = 0, replicate: bool = False) -> None:
    """Read until ``expected`` orders arrived, reconnecting with the last id."""
    last_id = "0"
    try:
        while len(set(reader.orders)) < expected:
            reader.connections += 1
            taken = 0
            for event in stream(host, port, path, last_event_id=last_id):
                taken += _take(reader, event, replicate=replicate and reader.connections == 1)
                if event.id is not None:
                    last_id = event.id
                if len(set(reader.orders)) >= expected or (cut_every and taken >= cut_every):
                    break
    except Exception as error:  # reported in the summary line, not lost in a thread
        reader.error = repr(error)
    finally:
        reader.done.set()


def _take(reader: Reader, event: StreamEvent, *, replicate: bool) -> int:
    if event.kind == "live":
        reader.live.set()
    if event.kind == "sales.OrderPlaced":
        reader.orders.append(event.data["body"]["order_id"])
        return 1
    if replicate and event.kind == "Order":
        reader.orders.append(event.data["aggregate_id"])
        reader.states += 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m samples.stream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=200, help="orders to place (200)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    commands = list(order_commands(args.orders, max(1, args.orders // 5), seed=args.seed))
    followed = sum(1 for command, _, _ in commands if command.customer == FOLLOWED_CUSTOMER)
    system = build(namespace=uuid.uuid4().hex[:8], journal=True,
                   middleware=[RandomCrashes(0.05, seed=args.seed)])
    gateway = Gateway(system.sales, port=0)
    readers = {"follower": Reader(), "customer": Reader(), "replica": Reader()}
    threads: list[threading.Thread] = []

    def reader_thread(name: str, **options: object) -> None:
        host, port = gateway.address
        thread = threading.Thread(target=follow, args=(host, port, readers[name]),
                                  kwargs=options, name=f"sample-{name}")
        thread.start()
        threads.append(thread)

    try:
        system.start()
        gateway.start()
        reader_thread("follower", expected=args.orders, cut_every=37)
        reader_thread("customer", expected=followed,
                      path=f"/?parents=customer/{FOLLOWED_CUSTOMER}")
        for name in ("follower", "customer"):  # both replicated the empty state: following
            if not readers[name].live.wait(30):
                raise RuntimeError(f"the {name} did not get to the live stream")
        send_orders(system.sales.bus.send, commands[: args.orders // 2])
        wait_until_idle([system.sales])
        reader_thread("replica", expected=args.orders, replicate=True)
        send_orders(system.sales.bus.send, commands[args.orders // 2:])
        wait_until_idle(system.endpoints)
        for thread in threads:
            thread.join(120)
    finally:
        gateway.stop()
        system.close()
    summary = Summary.of(args.orders, followed, readers,
                         journaled=system.sales.storage.journal_bounds().size)
    print(summary.line())
    return 0 if summary.ok else 1


def send_orders(send: Callable[..., str], commands: list[tuple[PlaceOrder, str, bool]]) -> None:
    for command, message_id, twice in commands:
        send(command, message_id=message_id)
        if twice:
            send(command, message_id=message_id)


@dataclass(frozen=True)
class Summary:
    orders: int
    journaled: int
    follower: int
    follower_connections: int
    customer: str
    replica_states: int
    replica: int
    #: Orders the replica got both as a state and as an event: committed between the live
    #: position and the reading of the states (allowed: nothing is lost in the switch).
    replica_overlap: int
    repeated: int
    lost: int
    errors: str

    @classmethod
    def of(cls, orders: int, followed: int, readers: dict[str, Reader], *,
           journaled: int) -> Summary:
        everyone = [f"order-{n}" for n in range(orders)]
        follower, customer, replica = (readers[n] for n in ("follower", "customer", "replica"))
        repeated = sum(len(r.orders) - len(set(r.orders)) for r in (follower, customer))
        lost = (len(set(everyone) - set(follower.orders))
                + len(set(everyone) - set(replica.orders)) + followed - len(set(customer.orders)))
        errors = ";".join(r.error for r in readers.values() if r.error) or "none"
        return cls(orders, journaled, len(set(follower.orders)), follower.connections,
                   f"{len(set(customer.orders))}/{followed}", replica.states,
                   len(set(replica.orders)), len(replica.orders) - len(set(replica.orders)),
                   repeated, lost, errors)

    @property
    def ok(self) -> bool:
        return (self.repeated == 0 and self.lost == 0 and self.errors == "none"
                and self.journaled == self.orders)

    def line(self) -> str:
        return " ".join(f"{name}={value}" for name, value in vars(self).items())


if __name__ == "__main__":
    sys.exit(main())
