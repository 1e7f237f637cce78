"""The audit trail: what happened to each message at each handler, kept in the storage for
analysis (``idembus spark report``). Opt in with ``Endpoint(middleware=[Audit()])``.

Written from the endpoint's signals, in batches by a background thread: an audit record
is an observation, so a write that fails is logged and dropped, and the hot path only
appends to a list.
"""

from __future__ import annotations

from typing import Any

from ..envelope import parse_utc, utc_now
from ..errors import ConfigurationError
from ..pipeline import Middleware
from ..signals import EndpointSignals
from ..storage.base import AuditRecord, AuditStore
from ..storage.write_behind import Batcher

#: The signals an audit record is kept for.
AUDITED = ("handled", "duplicate", "redispatched", "failed", "dead_lettered")


class AuditTrail:
    """Turns one endpoint's signals into audit records in its storage."""

    def __init__(self, storage: AuditStore, signals: EndpointSignals, *, endpoint: str) -> None:
        self._endpoint = endpoint
        self._batcher: Batcher[AuditRecord] = Batcher(
            storage.write_audit, name=f"idembus-{endpoint}-audit", interval=0.2)
        self._receivers = [self._recorder(outcome) for outcome in AUDITED]
        for outcome, receiver in zip(AUDITED, self._receivers, strict=True):
            getattr(signals, outcome).connect(receiver)

    def _recorder(self, outcome: str) -> Any:
        def record(sender: object, **details: Any) -> None:
            self._batcher.add(AuditRecord(
                endpoint=self._endpoint, handler=str(details.get("handler") or ""),
                message_id=str(details.get("message_id") or ""),
                message_type=str(details.get("message_type") or ""), outcome=outcome,
                time_sent=parse_utc(details.get("time_sent")), recorded_at=utc_now(),
            ))

        return record

    def flush(self) -> None:
        """Wait until every record so far is written."""
        self._batcher.flush()

    def close(self, timeout: float | None = 5.0) -> None:
        """Write what is pending, waiting at most ``timeout`` seconds (what is left is
        logged at ERROR with a count, never waited for forever)."""
        self._batcher.close(timeout)


class Audit(Middleware):
    """Middleware that keeps the audit trail of its endpoint (:class:`AuditTrail`) in the
    endpoint's storage. On close it waits at most ``close_timeout`` seconds for pending
    records (an audit record is an observation: never worth holding a shutdown)."""

    storage_roles = frozenset({"audit"})

    def __init__(self, *, close_timeout: float = 5.0) -> None:
        self.close_timeout = close_timeout
        self._trail: AuditTrail | None = None

    def setup(self, endpoint: Any) -> None:
        if self._trail is not None:
            raise ConfigurationError("an Audit middleware serves one endpoint; give each its own")
        self._trail = AuditTrail(endpoint.storage, endpoint.signals, endpoint=endpoint.name)

    def flush(self) -> None:
        """Wait until every record so far is written."""
        if self._trail is not None:
            self._trail.flush()

    def close(self) -> None:
        if self._trail is not None:
            self._trail.close(self.close_timeout)
