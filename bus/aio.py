"""Moved to :mod:`idembus.runtime.aio`; this old import path keeps working for one release
(``from idembus import LoopLocal`` is the stable spelling)."""

from __future__ import annotations

import warnings

from .runtime.aio import LoopLocal

__all__ = ["LoopLocal"]

warnings.warn("idembus.aio moved to idembus.runtime.aio: import LoopLocal from idembus",
              DeprecationWarning, stacklevel=2)
