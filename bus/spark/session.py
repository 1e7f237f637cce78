"""A SparkSession for idembus's commands, set up the way its Python workers need."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


@contextlib.contextmanager
def spark_session(master: str = "local[*]", *, app: str = "idembus") -> Iterator[Any]:
    """Start a session on ``master`` and stop it at the end; workers run this very
    interpreter (they crash on another one).

    If this thread already has an active session (a program or a test suite calling the
    command in-process), that one is used as it is and left running: whoever started it
    stops it.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        running = active.sparkContext.master
        if running != master:
            log.warning("using the active Spark session on %s, not %s", running, master)
        yield active
        return
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    session = (SparkSession.builder.master(master).appName(app)
               .config("spark.ui.enabled", "false").getOrCreate())
    try:
        yield session
    finally:
        session.stop()
