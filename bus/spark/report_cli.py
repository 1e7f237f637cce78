"""``idembus spark report package.module:endpoint``: the audit trail analysed on Spark
(:func:`idembus.spark.report.report`): a table per message type and endpoint, and a PNG."""

from __future__ import annotations

import argparse
import pathlib


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoint", help="package.module:endpoint (or factory) whose storage "
                                         "holds the audit trail (Endpoint(middleware=[Audit()]))")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("idembus-report"),
                        help="directory for report.csv and report.png (idembus-report)")
    parser.add_argument("--partitions", type=int, default=4,
                        help="parallel readers of the audit trail (4)")


def run(args: argparse.Namespace) -> int:
    from .report import report
    from .session import session_for

    with session_for(args, app="idembus report") as spark:
        result = report(spark, args.endpoint, out=args.out, partitions=args.partitions)
    print(result.table)
    print(f"written: {result.csv} {result.chart}")
    return 0
