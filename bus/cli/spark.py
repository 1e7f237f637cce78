"""``idembus spark replay ...``, ``idembus spark report ...`` and ``idembus spark reconcile
...`` (the ``[spark]`` extra).

The options are declared by :mod:`idembus.spark.replay_cli`, :mod:`idembus.spark.report_cli` and
:mod:`idembus.spark.reconcile_cli`, which import pyspark only when a command runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    from ..spark import reconcile_cli, replay_cli, report_cli
    from ..spark.session import conf_pair, path_list

    spark = commands.add_parser("spark", help="bulk work on Spark: replay messages, report, "
                                              "reconcile with a dump")
    actions = spark.add_subparsers(dest="spark_command", required=True)
    for name, module, summary, description in (
        ("replay", replay_cli, "feed messages from files through an endpoint's handlers", None),
        ("report", report_cli, "analyse the audit trail: counts, duplicates, latency", None),
        ("reconcile", reconcile_cli, "compare stored aggregates with a dump of the source "
                                     "data; publish and journal the differences",
         reconcile_cli.DESCRIPTION),
    ):
        parser = actions.add_parser(name, parents=[common], help=summary,
                                    description=description,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--master", default="local[*]",
                            help="Spark master URL (local[*]; a cluster's to run there, "
                                 "such as spark://HOST:7077)")
        parser.add_argument("--conf", action="append", type=conf_pair, metavar="KEY=VALUE",
                            help="a Spark property, repeatable: spark.executorEnv.NAME=VALUE "
                                 "sets a variable for the executors (a cluster's do not see "
                                 "this environment), spark.driver.host=ADDRESS where they "
                                 "reach the driver")
        parser.add_argument("--py-files", action="append", type=path_list,
                            metavar="FILE[,FILE...]",
                            help=".py, .zip or .egg files shipped to the executors and put on "
                                 "their Python path: the endpoint's module and what it "
                                 "imports, unless installed where the workers run")
        module.add_arguments(parser)
        parser.set_defaults(handler=module.run)
