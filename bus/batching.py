"""How an endpoint takes its deliveries in batches (``Endpoint(batching=Batching(...))``).

A consumer takes the deliveries that are ready, up to ``size``, waiting at most ``linger``
seconds for more once it has one; the batch's loads reach the database in one round trip,
its commits in another (each still its own conditional write), its outgoing messages are
published and their confirms awaited once, and the deliveries are acknowledged together.
Each message keeps its own handlers, deduplication, retries and failure path
(:mod:`idembus.batch_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batching:
    """Batched consumption: ``size`` deliveries at most a batch (``None``: the endpoint's
    ``prefetch``), ``linger`` seconds at most waited for more once one is ready.

    ``Batching(size=1)`` is processing one message at a time, through the same path."""

    size: int | None = None
    linger: float = 0.002

    def __post_init__(self) -> None:
        if self.size is not None and (isinstance(self.size, bool) or self.size < 1):
            raise ValueError(f"batch size must be at least 1, got {self.size!r}")
        if not self.linger >= 0:
            raise ValueError(f"batch linger must be a non-negative number of seconds, "
                             f"got {self.linger!r}")

    def size_for(self, prefetch: int) -> int:
        """The batch size an endpoint with ``prefetch`` uses."""
        return self.size if self.size is not None else prefetch


#: What an endpoint batches with unless told otherwise (``Endpoint(batching=None)``: one
#: message at a time).
DEFAULT_BATCHING = Batching()
