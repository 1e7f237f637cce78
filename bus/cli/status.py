"""``idembus status package.module:endpoint [--json]``: the counters of an endpoint's
processes, as each last reported them to the storage (:mod:`idembus.runtime.status`).

The reports of other processes can only be read from a storage they share: an endpoint on
a process-local storage (MemoryStorage, an embedded mongomock) is refused with exit status
2 and the reason, never shown as "0 process(es) running".
"""

from __future__ import annotations

import argparse
import datetime
import json
from typing import Any

from ..envelope import utc_now
from ..runtime.loading import load_endpoint, refuse_process_local
from ..runtime.status import HIDDEN_AFTER, summarise
from ..signals import SIGNAL_NAMES

#: A running process that has not reported for this many status intervals counts as gone.
_STALE_AFTER_INTERVALS = 3
#: Reports older than this are deleted when ``idembus status`` runs.
FORGOTTEN_AFTER = datetime.timedelta(days=1)


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    status = commands.add_parser(
        "status", parents=[common],
        help="print the counters of an endpoint's processes (received, handled, duplicates...)")
    status.add_argument("endpoint", help="package.module:endpoint")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--all", action="store_true",
                        help="also the processes not heard of for an hour")
    status.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    endpoint = load_endpoint(args.endpoint)
    now = utc_now()
    try:
        # Another process's reports are in a shared storage only; in a process-local one
        # this command would always find "0 process(es) running".
        refuse_process_local(endpoint.storage, endpoint=endpoint.name, role="storage",
                             unseen="status reports")
        endpoint.storage.forget_status(endpoint.name, updated_before=now - FORGOTTEN_AFTER)
        reports = endpoint.storage.status_reports(endpoint.name)
        stale_after = datetime.timedelta(seconds=_STALE_AFTER_INTERVALS * endpoint.status_interval)
    finally:
        endpoint.close()
    shown = reports if args.all else [r for r in reports if now - r.updated_at <= HIDDEN_AFTER]
    summary = summarise(endpoint.name, shown, now=now, stale_after=stale_after)
    summary["hidden"] = len(reports) - len(shown)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


def render(summary: dict[str, Any]) -> str:
    """The summary as a table, one column per counter."""
    columns = list(SIGNAL_NAMES)
    rows = [["instance", "state", *columns]]
    for instance in summary["instances"]:
        rows.append([instance["instance"], instance["state"],
                     *(str(instance["counters"][key]) for key in columns)])
    rows.append(["total (running)", str(summary["running"]),
                 *(str(summary["total"][key]) for key in columns)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"endpoint {summary['endpoint']}: {summary['running']} process(es) running"]
    if summary.get("hidden"):
        lines[0] += (f" ({summary['hidden']} not heard of for an hour hidden: "
                     "--all shows them)")
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              for row in rows]
    for instance in summary["instances"]:
        if instance["state"] == "running":
            lines += [f"PROBLEM {instance['instance']} ({source}): {text}"
                      for source, text in sorted(instance["problems"].items())]
    return "\n".join(line.rstrip() for line in lines)
