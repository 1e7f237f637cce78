"""The performance guard: the memory:// flow's calls per handled message, against the count
committed in bench/results/guard.json (bench/guard.py says how it is counted and how to
update it). A count, not a time: it does not move with the machine's load.

Marked ``guard``: ``make test`` (CI) runs it, ``make check`` does not (the count depends on
the interpreter's and the dependencies' versions, which CI pins and a laptop may not).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from bench import guard

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.guard, pytest.mark.timeout(90)]


def test_the_memory_flow_makes_no_more_calls_a_message_than_committed():
    # In a process of its own: other tests' log handlers, caches and signal receivers
    # would be counted too.
    done = subprocess.run([sys.executable, "-m", "bench.guard", "--check"], cwd=ROOT,
                          env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True,
                          text=True, timeout=80, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "calls per handled message" in done.stdout, done.stdout + done.stderr[-3000:]


def test_a_count_above_the_tolerance_fails_with_how_to_update_it():
    committed = guard.committed()
    limit = committed["calls_per_message"] * (1 + guard.TOLERANCE)
    assert guard.verdict(limit, committed) is None
    failure = guard.verdict(limit + 1, committed)
    assert failure is not None
    assert "python -m bench.guard --update --reason" in failure
    assert "bench/results/guard.json" in failure
