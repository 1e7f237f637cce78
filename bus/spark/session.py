"""A SparkSession for idembus's commands, set up the way its Python workers need."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import ConfigurationError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def spark_session(master: str = "local[*]", *, app: str = "idembus",
                  conf: Mapping[str, str] | None = None,
                  py_files: Sequence[str] = ()) -> Iterator[Any]:
    """Start a session on ``master`` and stop it at the end; workers run this very
    interpreter (they crash on another one), so on a cluster its path must exist on every
    worker machine.

    ``conf``: Spark properties (``spark.executorEnv.NAME``: a variable in the executors'
    environment, which a cluster's executors do not inherit from this process;
    ``spark.driver.host``: the address executors reach the driver at). ``py_files``:
    ``.py``, ``.zip`` or ``.egg`` files shipped to the executors and put on their Python
    path (``SparkContext.addPyFile``), for modules the workers do not have installed.

    If this thread already has an active session (a program or a test suite calling the
    command in-process), that one is used as it is and left running: whoever started it
    stops it; ``conf`` cannot change it and is ignored with a warning.
    """
    from pyspark.sql import SparkSession

    missing = [path for path in py_files if not os.path.isfile(path)]
    if missing:
        raise ConfigurationError(
            f"no such file to ship to the executors (--py-files): {', '.join(missing)}")
    active = SparkSession.getActiveSession()
    if active is not None:
        running = active.sparkContext.master
        if running != master:
            log.warning("using the active Spark session on %s, not %s", running, master)
        if conf:
            log.warning("the active Spark session keeps its settings: ignoring %s",
                        ", ".join(sorted(conf)))
        _ship(active, py_files)
        yield active
        return
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app).config("spark.ui.enabled",
                                                                      "false")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    try:
        _ship(session, py_files)
        yield session
    finally:
        session.stop()


def _ship(session: Any, py_files: Sequence[str]) -> None:
    for path in py_files:
        session.sparkContext.addPyFile(os.path.abspath(path))


def session_for(args: argparse.Namespace, *, app: str) -> contextlib.AbstractContextManager[Any]:
    """:func:`spark_session` with the options every ``idembus spark`` command takes:
    ``--master``, ``--conf KEY=VALUE`` and ``--py-files``."""
    return spark_session(args.master, app=app, conf=dict(args.conf or ()),
                         py_files=[path for group in args.py_files or () for path in group])


def conf_pair(text: str) -> tuple[str, str]:
    """``--conf KEY=VALUE`` as a pair (argparse ``type``)."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=VALUE; write for instance "
            "--conf spark.executorEnv.IDEMBUS_POSTGRES_URL=postgresql://db/shop")
    return key.strip(), value


def path_list(text: str) -> list[str]:
    """``--py-files a.py,b.zip`` as a list of paths (argparse ``type``)."""
    return [part.strip() for part in text.split(",") if part.strip()]
