"""Moved to :mod:`idembus.observability.metrics`; this old import path keeps working for one release
(``from idembus import Metrics`` is the stable spelling)."""

from __future__ import annotations

import warnings

from .observability.metrics import Metrics

__all__ = ["Metrics"]

warnings.warn("idembus.metrics moved to idembus.observability.metrics: import Metrics from idembus",
              DeprecationWarning, stacklevel=2)
