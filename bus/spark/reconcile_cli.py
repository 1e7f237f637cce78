"""``idembus spark reconcile package.module:endpoint --dump FILE...``: the endpoint's stored
aggregates compared with an authoritative dump on Spark, and a ``Reconciled`` event
published and journaled per difference (:func:`idembus.spark.reconcile.reconcile`)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Compare the aggregates the endpoint's storage holds with a dump of the source data, and
publish (through the endpoint's transport) and append to the event journal one
idembus.Reconciled event per difference. Nothing is emitted with --dry-run.

The dump: JSON lines {"type": "Account", "id": "a7", "timestamp": ..., "parents": [...]}.
type is the stored aggregate type (AggregateHandler.storage_name()) of one of the
endpoint's handlers; timestamp, when the source object last changed, is ISO 8601
(2026-01-01T12:00:00Z; no zone means UTC) or milliseconds since the epoch; parents
(optional) are references such as user/42. Any bad line fails the command before
anything is emitted (exit 2). An object listed twice counts once, at its newest timestamp.

Corrections, comparing on (type, id):
  missing  in the dump, not stored;
  stale    in both, and the dump's timestamp is later than the stored updated_at
           (or the storage does not know updated_at);
  deleted  stored, not in the dump: only for the types that appear in the dump (a dump of
           users never deletes videos), and only if the stored updated_at is not later
           than the newest timestamp in the dump (an aggregate changed after the dump was
           taken is left alone; an unknown updated_at is not later).

Each correction has a deterministic message id: running the same reconciliation again
appends nothing new to the journal, and subscribers deduplicate what is published again.
The endpoint's storage and transport are used on the driver only, so a process-local
endpoint (memory://) is accepted, though its storage is only what this process holds.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoint", help="package.module:endpoint (or factory) whose storage "
                                         "is reconciled and whose transport publishes")
    parser.add_argument("--dump", dest="dumps", action="extend", nargs="+", required=True,
                        metavar="PATH",
                        help="files or directories of the dump, JSON lines; repeat --dump or "
                             "name several paths after one (after the endpoint, which "
                             "would otherwise be taken for a path)")
    parser.add_argument("--dry-run", action="store_true",
                        help="report the corrections (the first 20 listed), emit nothing")


def run(args: argparse.Namespace) -> int:
    from .reconcile import reconcile
    from .session import session_for

    with session_for(args, app="idembus reconcile") as spark:
        summary = reconcile(spark, args.endpoint, args.dumps, dry_run=args.dry_run)
    print(summary.line())
    if args.dry_run:
        for correction in summary.preview:
            print(correction.line())
        hidden = summary.corrections - len(summary.preview)
        if hidden > 0:
            print(f"... and {hidden} more")
    return 0
