"""``idembus spark replay ...`` and ``idembus spark report ...`` (the ``[spark]`` extra).

The options are declared by :mod:`bus.spark.replay_cli` and :mod:`bus.spark.report_cli`,
which import pyspark only when a command runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    from bus.spark import replay_cli, report_cli

    spark = commands.add_parser("spark", help="bulk work on Spark: replay messages, report")
    actions = spark.add_subparsers(dest="spark_command", required=True)
    for name, module, summary in (
        ("replay", replay_cli, "feed messages from files through an endpoint's handlers"),
        ("report", report_cli, "analyse the audit trail: counts, duplicates, latency"),
    ):
        parser = actions.add_parser(name, parents=[common], help=summary)
        parser.add_argument("--master", default="local[*]",
                            help="Spark master URL (local[*]; a cluster's to run there)")
        module.add_arguments(parser)
        parser.set_defaults(handler=module.run)
