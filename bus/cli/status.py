"""``idembus status package.module:endpoint [--wide] [--json]``: an endpoint's ledger, as
each of its processes last reported it to the storage (:mod:`idembus.runtime.status`),
its queue's depth and lag, and, if it handles ordered messages, the depths of its
partition queues (RabbitMQ; ``--wide``: each) or its keys in flight (the database queues).

The table shows the ledger, whose terms add up to ``received``
(:mod:`idembus.runtime.counters`), and fits 120 columns (long instance names are cut at
the front, long lines wrapped); ``--wide`` adds every signal counter and the lag of each
process; ``--json`` prints everything.

The reports of other processes can only be read from a storage they share: an endpoint on
a process-local storage (MemoryStorage, an embedded mongomock) is refused with exit status
2 and the reason, never shown as "0 process(es) running".
"""

from __future__ import annotations

import argparse
import datetime
import json
import textwrap
from typing import Any

from ..envelope import parse_utc, utc_now
from ..runtime.counters import LEDGER
from ..runtime.loading import load_endpoint, refuse_process_local
from ..runtime.status import (
    HIDDEN_AFTER,
    duration_text,
    ordering_depth,
    queue_depth,
    summarise,
)
from ..signals import SIGNAL_NAMES

#: A running process that has not reported for this many status intervals counts as gone.
_STALE_AFTER_INTERVALS = 3
#: Reports older than this are deleted when ``idembus status`` runs.
FORGOTTEN_AFTER = datetime.timedelta(days=1)
#: The widest line ``idembus status`` prints without ``--wide``.
WIDTH = 120
#: The signal counters ``--wide`` adds (``received`` is the ledger's; ``settled`` is
#: received minus in flight).
_SIGNALS_SHOWN = tuple(name for name in SIGNAL_NAMES if name not in ("received", "settled"))
#: What a figure nobody can tell reads as.
UNKNOWN = "–"


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    status = commands.add_parser(
        "status", parents=[common],
        help="print an endpoint's ledger (received = handled + duplicate + ...), its queue's "
             "depth and lag, per process")
    status.add_argument("endpoint", help="package.module:endpoint")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--wide", action="store_true",
                        help="every counter and each process's lag, however wide")
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
        visible = not endpoint.transport.process_local
        depth = None if endpoint.send_only else queue_depth(
            endpoint.transport, endpoint.name, visible=visible)
        ordering = None if endpoint.send_only else ordering_depth(
            endpoint.transport, endpoint.name, partitions=endpoint.partitions,
            ordered=bool(endpoint.ordered_types), visible=visible)
    finally:
        endpoint.close()
    shown = reports if args.all else [r for r in reports if now - r.updated_at <= HIDDEN_AFTER]
    summary = summarise(endpoint.name, shown, now=now, stale_after=stale_after)
    summary["hidden"] = len(reports) - len(shown)
    summary["queue"] = depth
    summary["ordering"] = ordering
    print(json.dumps(summary, indent=2) if args.json
          else render(summary, wide=args.wide, now=now))
    return 0


def render(summary: dict[str, Any], *, wide: bool = False,
           now: datetime.datetime | None = None) -> str:
    """The summary as text: a header, the queue's depth and lag, the ledger of each
    process and their total, then what blocks a running process. Every line fits
    :data:`WIDTH` columns unless ``wide``."""
    now = now or utc_now()
    terms = list(LEDGER)
    head = ["instance", "state", "received", *(term.replace("_", "-") for term in terms)]
    rows = []
    for instance in summary["instances"]:
        rows.append([instance["instance"], instance["state"],
                     *_figures(instance["ledger"], terms)]
                    + (_wide_cells(instance, now) if wide else []))
    rows.append(["total (running)", str(summary["running"]), *_figures(summary["ledger"], terms)]
                + (_wide_cells(summary, now) if wide else []))
    if wide:
        head += ["last settled", "lag", "|", *_SIGNALS_SHOWN]
    header = f"endpoint {summary['endpoint']}: {summary['running']} process(es) running"
    if summary.get("hidden"):
        header += (f" ({summary['hidden']} not heard of for an hour hidden: "
                   "--all shows them)")
    lines = _wrapped(header, wide)
    lines += _wrapped(_queue_line(summary.get("queue")), wide, indent="  ")
    lines += _ordering_lines(summary.get("ordering"), wide)
    lines += _wrapped(f"last settled {_ago(summary.get('last_settled'), now)}, "
                      f"lag {_seconds(summary.get('lag_seconds'))} (from when it was sent, or "
                      "due, until it was settled)", wide, indent="  ")
    identity = "received = " + " + ".join(term.replace("_", "-") for term in terms)
    lines += _wrapped(identity + ("" if wide else " (--wide explains)"), wide,
                      indent="  ")
    if wide:
        lines += [f"  {term.replace('_', '-')}: {meaning}" for term, meaning in LEDGER.items()]
        lines += ["after |: the signal counters, per handler, attempt or message sent "
                  "(they do not add up to received)"]
    lines += _table([head, *rows], width=None if wide else WIDTH)
    for instance in summary["instances"]:
        if instance["state"] == "running":
            for source, text in sorted(instance["problems"].items()):
                lines += _wrapped(f"PROBLEM {instance['instance']} ({source}): {text}", wide,
                                  indent="  ")
    return "\n".join(line.rstrip() for line in lines)


def _figures(ledger: dict[str, int], terms: list[str]) -> list[str]:
    return [str(ledger["received"]), *(str(ledger[term]) for term in terms)]


def _wide_cells(part: dict[str, Any], now: datetime.datetime) -> list[str]:
    """``--wide``'s cells of an instance or the total: last settled, lag, every counter."""
    counters = part.get("counters", part.get("total", {}))
    return [_ago(part.get("last_settled"), now), _seconds(part.get("lag_seconds")), "|",
            *(str(counters.get(key, 0)) for key in _SIGNALS_SHOWN)]


def _queue_line(depth: dict[str, Any] | None) -> str:
    if depth is None:
        return "no queue (send-only endpoint)"
    if depth.get("unknown"):
        return f"queue {depth['queue']}: depth {UNKNOWN} ({depth['unknown']})"
    return (f"queue {depth['queue']}: ready {_count(depth['ready'])}, unacked "
            f"{_count(depth['unacked'])}, delayed {_count(depth['delayed'])}, consumers "
            f"{_count(depth['consumers'])}, oldest ready waiting "
            f"{_seconds(depth['oldest_seconds'])}")


def _ordering_lines(ordering: dict[str, Any] | None, wide: bool) -> list[str]:
    """The ordered messages: the partition queues' depths in sum (``wide``: each), or the
    keys in flight on a database queue; nothing for an endpoint without ordered types."""
    if ordering is None:
        return []
    if ordering.get("unknown"):
        return _wrapped(f"ordered: {UNKNOWN} ({ordering['unknown']})", wide, indent="  ")
    partitions = ordering.get("partitions") or []
    if not partitions:
        return _wrapped(
            f"ordered: keys in flight {_count(ordering.get('keys_in_flight'))}, ordered "
            f"messages waiting {_count(ordering.get('waiting'))}", wide, indent="  ")
    known = [p for p in partitions if not p.get("unknown")]
    ready = sum(p["ready"] or 0 for p in known)
    consumers = [p["consumers"] for p in known if p["consumers"] is not None]
    text = (f"ordered: {len(partitions)} partition queues {partitions[0]['queue']} .. "
            f"{partitions[-1]['queue']}: ready {ready}")
    if consumers:
        text += (f", consumers {min(consumers)} to {max(consumers)} per partition (one "
                 "active)")
    if len(known) < len(partitions):
        text += f", {len(partitions) - len(known)} unreadable"
    busiest = max(known, key=lambda p: p["ready"] or 0, default=None)
    if busiest is not None and busiest["ready"]:
        text += f"; most ready in {busiest['queue']} ({busiest['ready']})"
    lines = _wrapped(text, wide, indent="  ")
    if wide:
        lines += ["  " + _queue_line(partition) for partition in partitions]
    return lines


def _count(value: int | None) -> str:
    return UNKNOWN if value is None else str(value)


def _seconds(value: float | None) -> str:
    return UNKNOWN if value is None else duration_text(value)


def _ago(moment: str | None, now: datetime.datetime) -> str:
    parsed = parse_utc(moment)
    if parsed is None:
        return "never" if moment is None else UNKNOWN
    return f"{_seconds(max(0.0, (now - parsed).total_seconds()))} ago"


def _wrapped(text: str, wide: bool, *, indent: str = "") -> list[str]:
    """``text`` as lines of at most :data:`WIDTH` columns (one line if ``wide``)."""
    if wide:
        return [text]
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent or "  ",
                         break_long_words=True, break_on_hyphens=False) or [""]


def _table(rows: list[list[str]], *, width: int | None) -> list[str]:
    """Left-aligned columns two spaces apart; within ``width`` the first column (the
    instance names) is cut at the front ("…" and its end: pid and suffix) as needed."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    if width is not None:
        room = width - (sum(widths[1:]) + 2 * (len(widths) - 1))
        if widths[0] > room:
            widths[0] = max(room, 12)
            rows = [[_cut(row[0], widths[0]), *row[1:]] for row in rows]
    return ["  ".join(cell.ljust(size) for cell, size in zip(row, widths, strict=True))
            for row in rows]


def _cut(text: str, size: int) -> str:
    return text if len(text) <= size else "…" + text[len(text) - size + 1:]
