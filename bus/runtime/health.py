"""What keeps an endpoint process from working right now, for ``idembus status``.

Failures that are *permanent for the endpoint* (:class:`~idembus.errors.EndpointBlocked`: a
refused login, the endpoint's own queue refused, missing tables) are not any message's
fault and do not go away by waiting; the endpoint keeps trying, logs each attempt at ERROR
and records the problem here until an attempt succeeds. The status reporter writes the
problems with every report.
"""

from __future__ import annotations

import threading

from ..redaction import redact


class Health:
    """The current problems of one endpoint process, by source; thread-safe."""

    def __init__(self) -> None:
        self._problems: dict[str, str] = {}
        self._lock = threading.Lock()

    def problem(self, source: str, error: BaseException | str) -> None:
        """Record that ``source`` (``"transport"``, ``"storage"``) is blocked by ``error``."""
        with self._lock:
            self._problems[source] = redact(str(error))

    def resolved(self, source: str | None = None) -> None:
        """``source`` works again (``None``: everything does, e.g. a message went through)."""
        if not self._problems:  # the common case, on every message: no lock needed
            return
        with self._lock:
            if source is None:
                self._problems.clear()
            else:
                self._problems.pop(source, None)

    def problems(self) -> dict[str, str]:
        """The problems now, by source (empty when well)."""
        with self._lock:
            return dict(self._problems)
