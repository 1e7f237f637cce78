"""``idembus spark replay package.module:make_endpoint FILE...``: messages from JSON lines or
Parquet files through the endpoint's handlers on Spark (:func:`idembus.spark.replay.replay`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoint", help="package.module:factory of the endpoint, importable "
                                         "by Spark's workers (each builds its own)")
    parser.add_argument("inputs", nargs="+", help="files or directories of messages")
    parser.add_argument("--format", choices=("json", "parquet"), default="json",
                        help="json (one message per line: message_id, message_type, body, "
                             "headers, ...) or parquet (json)")
    parser.add_argument("--partition-by", default="aggregate_id", type=_column,
                        help="column keeping one aggregate's messages in one partition "
                             "(aggregate_id; 'none' to spread them freely)")
    parser.add_argument("--order-by", default="sequence", type=_column,
                        help="column ordering messages within a partition (sequence; "
                             "'none' to keep the input's order; an error-queue export has "
                             "time_of_failure)")
    parser.add_argument("--partitions", type=int, default=None,
                        help="Spark partitions (the session's default)")


def run(args: argparse.Namespace) -> int:
    from .replay import replay_files
    from .session import session_for

    with session_for(args, app="idembus replay") as spark:
        summary = replay_files(spark, args.inputs, args.endpoint, file_format=args.format,
                               partition_by=args.partition_by, order_by=args.order_by,
                               partitions=args.partitions)
    print(summary.line())
    return 0 if summary.ok else 1


def _column(name: str) -> str | None:
    return None if name.strip().lower() in ("", "none") else name
