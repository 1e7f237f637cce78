"""Process checks shared by the local clusters (:mod:`.cluster`, :mod:`.pg_cluster`)."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (a child of ours that
    ended but was not reaped yet is gone for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return state[0] != "Z"
