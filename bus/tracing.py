"""Moved to :mod:`idembus.observability.tracing`; this old import path keeps working for one release
(``from idembus import Tracing`` is the stable spelling)."""

from __future__ import annotations

import warnings

from .observability.tracing import Tracing

__all__ = ["Tracing"]

warnings.warn("idembus.tracing moved to idembus.observability.tracing: import Tracing from idembus",
              DeprecationWarning, stacklevel=2)
