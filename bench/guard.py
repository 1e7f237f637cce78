"""The performance guard: Python calls per handled message of the memory:// flow, a count.

Wall-clock rates on a shared machine scatter by a quarter; the number of function calls a
message costs does not move unless the code does. ``python -m bench.guard`` builds the
Sales -> Billing flow of :mod:`bench.idembus_flow` (memory://, MemoryStorage, no
middleware), queues the orders, and then hands the deliveries to each endpoint's processor
in this thread (:meth:`Endpoint.process_batch <idembus.runtime.endpoint.Endpoint.process_batch>`,
the batches a consumer thread runs: decode, load, handler, commit, dispatch through kombu's
memory transport, signals) with no consumer thread running, so nothing depends on timing.
A :func:`sys.setprofile` hook counts every Python and C function call made while the
counted orders are processed, after a warm-up round of the same size, and the count is
divided by the messages handled (two per order: Sales', Billing's).

``tests/test_performance_guard.py`` (``make test``) fails when the count grows more than
:data:`TOLERANCE` above the one committed in ``bench/results/guard.json``. A change that
moves it on purpose updates that file in the same commit, with the reason::

    python -m bench.guard --update --reason "why the count moved"

The count depends on the interpreter's version and on kombu's and pydantic's (their calls
are counted too): the file records them, and a failure says which differ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

from bench import idembus_flow
from bench.common import orders as bench_orders
from idembus.messages import message_name
from samples.ordering.messages import OrderBilled

#: The committed count, its command and the environment it was measured in.
RESULT = Path(__file__).resolve().parent / "results" / "guard.json"
#: How far above the committed count the test lets the count grow.
TOLERANCE = 0.10
#: Orders per round (the warm-up round and the counted one): two batches of the flow's
#: endpoints (prefetch 16, batches of 16).
ORDERS = 32
COMMAND = "python -m bench.guard"
#: Distributions whose calls are counted besides idembus's (their versions move the count).
DEPENDENCIES = ("kombu", "pydantic", "pydantic-core", "blinker")


class _CallCounter:
    """A profile function counting Python and C calls while it is installed."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1


def _process(flow: idembus_flow.Flow) -> None:
    """Take every message waiting for Sales and hand them to Sales' processor, then the
    same for Billing (the OrderPlaced events Sales published)."""
    for endpoint in (flow.sales, flow.billing):
        with endpoint.transport.inspect(endpoint.name) as deliveries:  # taken unsettled
            endpoint.process_batch(deliveries)  # each acknowledged as a consumer's


def calls_per_message(orders: int = ORDERS) -> float:
    """Function calls per handled message over ``orders`` orders, after as many warming
    up (see the module docstring)."""
    flow = idembus_flow.build_flow("memory://", "memory", 2 * orders, confirm=True)
    # Billing's OrderBilled events go to a queue of their own: an event no queue takes is
    # logged at most every 10 s, a branch taken by the clock, not by the count.
    sink = f"{flow.billing.name}-sink"
    flow.transport.declare(sink, subscriptions=[message_name(OrderBilled)])
    try:
        commands = list(bench_orders(2 * orders))  # distinct orders, as in the benchmark
        for command in commands[:orders]:
            flow.sales.bus.send(command)
        _process(flow)  # the warm-up: first-use caches, lazy imports, compiled validators
        for command in commands[orders:]:
            flow.sales.bus.send(command)
        counter = _CallCounter()
        sys.setprofile(counter)
        try:
            _process(flow)
        finally:
            sys.setprofile(None)
        idembus_flow.check(flow, 2 * orders)
    finally:
        for each in flow.endpoints:
            each.close()
        flow.transport.delete_queue(sink)
        idembus_flow.cleanup(flow)
    return counter.calls / (2 * orders)


def environment() -> dict[str, str]:
    """The interpreter's and the counted dependencies' versions."""
    versions = {"python": platform.python_version()}
    for name in DEPENDENCIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def committed() -> dict[str, Any]:
    """The committed guard (``bench/results/guard.json``)."""
    result: dict[str, Any] = json.loads(RESULT.read_text(encoding="utf-8"))
    return result


def _head() -> str:
    """The commit the working tree is at, with ``+changes`` when it differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=RESULT.parent, capture_output=True,
                              text=True, check=False).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--", "../..") else "")


def verdict(count: float, result: dict[str, Any]) -> str | None:
    """Why ``count`` fails the committed guard ``result``, or ``None`` when it passes."""
    before = float(result["calls_per_message"])
    if count <= before * (1 + TOLERANCE):
        return None
    recorded = result.get("environment", {})
    moved = [f"{name} {recorded.get(name)} -> {version}"
             for name, version in environment().items() if recorded.get(name) != version]
    because = (f" The environment differs from the recorded one ({', '.join(moved)}): "
               "their calls are counted too." if moved else "")
    return (f"the memory:// flow makes {count:,.1f} calls per handled message, "
            f"{count / before - 1:+.1%} over the {before:,.1f} committed in "
            f"bench/results/guard.json (at most {TOLERANCE:+.0%}).{because} Find the extra "
            f"work in the per-message path ({COMMAND} prints the count), or, if the change "
            f"is worth it, update the count in the same commit: {COMMAND} --update "
            "--reason 'what costs more and why' (and commit bench/results/guard.json).")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0]
                                     if __doc__ else None)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true",
                      help=f"exit 1 when the count is more than {TOLERANCE:.0%} above the "
                           "committed one")
    what.add_argument("--update", action="store_true",
                      help=f"write the count to {RESULT.relative_to(RESULT.parents[2])}")
    parser.add_argument("--reason", default="",
                        help="why the count moved (required with --update)")
    args = parser.parse_args(argv)
    if args.update and not args.reason.strip():
        parser.error("--update needs --reason: say why the count moved")
    count = calls_per_message()
    print(f"calls per handled message (memory:// flow, {ORDERS} orders): {count:,.1f}")
    if RESULT.exists():
        result = committed()
        before = float(result["calls_per_message"])
        print(f"committed: {before:,.1f} ({count / before - 1:+.1%})")
        if args.check and (failure := verdict(count, result)) is not None:
            print(failure)
            return 1
    elif args.check:
        print(f"no committed count at {RESULT}: run {COMMAND} --update --reason ...")
        return 1
    if args.update:
        RESULT.write_text(json.dumps({
            "date": datetime.date.today().isoformat(),
            "name": "guard",
            "command": COMMAND,
            "machine": "any: a count of function calls (sys.setprofile), not a time",
            "calls_per_message": round(count, 1),
            "orders": ORDERS,
            "tolerance": TOLERANCE,
            "environment": environment(),
            "reason": args.reason.strip(),
            "measured_at_commit": _head(),
        }, indent=2) + "\n", encoding="utf-8")
        print(f"written to {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
