"""Helpers for tests and samples that run endpoints in one process."""

from __future__ import annotations

import time
from typing import Iterable

from bus.endpoint import Endpoint

#: Consecutive idle observations required before endpoints count as quiescent.
_SETTLED_ROUNDS = 3


def wait_until_idle(endpoints: Iterable[Endpoint], *, timeout: float = 30.0,
                    interval: float = 0.02) -> None:
    """Return once every endpoint's queue is empty and nothing is being processed,
    observed several times in a row (a message one endpoint is sending to another is
    seen on the next look). Raises ``TimeoutError`` after ``timeout`` seconds."""
    chosen = list(endpoints)
    deadline = time.monotonic() + timeout
    settled = 0
    while settled < _SETTLED_ROUNDS:
        if time.monotonic() > deadline:
            busy = [e.name for e in chosen if not e.is_idle()]
            raise TimeoutError(f"endpoints still busy after {timeout}s: {busy}")
        if all(endpoint.is_idle() for endpoint in chosen):
            settled += 1
        else:
            settled = 0
        chosen[0].wait_for_activity(interval)
