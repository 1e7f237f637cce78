"""The failure taxonomy for PostgreSQL, decided from the SQLSTATE the server sent, and from
psycopg's classes only when it sent none.

psycopg's classes follow the DB-API, not this taxonomy: a program limit (``54000``) is an
``OperationalError`` like a lost connection, and a read-only standby's refusal (``25006``)
an ``InternalError``. So the SQLSTATE decides:

* *transient* (:class:`~idembus.storage.errors.StorageUnavailable`), waited out with backoff while
  the message keeps its place: classes ``08`` (connection exception), ``40`` (serialization
  failure, deadlock), ``53`` (insufficient resources: disk full, out of memory, too many
  connections), ``57`` (operator intervention: shutdown, crash recovery, starting up, a
  cancelled statement, an idle session closed) but ``57P04``; and ``55P03`` (a lock not
  granted within ``lock_timeout``), ``25P03`` (the server ended a transaction left idle),
  ``25006`` (a read-only transaction: a standby after a failover, or a primary made
  read-only; that connection is discarded, so the next attempt connects afresh),
  ``58000``/``58030`` (the server's I/O failed), ``72000`` (snapshot too old). Without a
  SQLSTATE: a connection lost or refused, the pool's timeout.

  ``57014`` (``statement_timeout`` or a cancel) and ``55P03`` could in theory be one
  message's doing (a state so large that writing it outlasts the timeout), but they are
  what every message meets while the database is overloaded, locked by a migration or
  failing over; treating them as the message's would send every message of that time to
  the error queue. A message that really always times out waits in place, logged at
  WARNING each time, until the timeout is raised.
* *permanent for the endpoint* (:class:`~idembus.storage.errors.StorageAccessDenied`), logged at
  ERROR, shown in ``idembus status``, and a configuration error at start: ``28`` (login
  refused), ``3D000`` (no such database), ``3F000`` (no such schema), ``42`` (a privilege
  missing, a table or column missing or of another type: the data of a message only ever
  travels as parameters, so a class-42 error is the schema's, never the message's; a
  missing table, ``42P01``, is :class:`~idembus.storage.errors.SchemaMissing`),
  ``0A000`` (a feature the server lacks), ``57P04`` (the database was dropped: no wait
  brings it back), ``XX001``/``XX002`` (data or index corrupted), ``F0`` (the server's
  configuration file). Without a SQLSTATE: libpq's words for a refused login.
* *permanent for this message* (:class:`~idembus.storage.errors.StorageRefused`): everything else
  the server or psycopg refuses — ``22`` data exceptions (a NUL character, a bad escape),
  ``23`` integrity, ``54`` program limits (an index row too large), psycopg's own
  ``DataError`` for text it cannot send. The message fails like any other and goes to the
  error queue after its retries; the circuit breaker ignores it.

A refused login reaches the pool as a timeout; :func:`login_problem` asks the server once
more, directly, to tell the two apart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from ..redaction import redact
from .errors import (
    SchemaMissing,
    StorageAccessDenied,
    StorageError,
    StorageRefused,
    StorageUnavailable,
)

log = logging.getLogger(__name__)

_TRANSIENT_CLASSES = ("08", "40", "53", "57")
_TRANSIENT_STATES = frozenset({"55P03", "25P03", "25006", "58000", "58030", "72000"})
_ENDPOINT_CLASSES = ("28", "42", "F0")
_ENDPOINT_STATES = frozenset({"3D000", "3F000", "0A000", "57P04", "XX001", "XX002"})
#: A table that does not exist: the schema was never created (``idembus migrate``).
_UNDEFINED_TABLE = "42P01"
#: The refusal after which a pooled connection must not be used again (it may be connected
#: to a standby that a failover left behind).
_DISCARDING_STATES = frozenset({"25006"})
#: What libpq says (with no SQLSTATE) when the server refuses the login itself.
_LOGIN_REFUSALS = ("authentication failed", "pg_hba.conf", "does not exist",
                   "permission denied", "not permitted to log in", "no password supplied")


def classified(error: Exception, where: str) -> StorageError:
    """The storage error for ``error``, met while talking to the database ``where`` (its
    conninfo or name; a password in it is hidden)."""
    state = getattr(error, "sqlstate", None) or ""
    where = redact(where)
    said = _one_line(redact(str(error)))
    text = f"PostgreSQL at {where}: {said}"
    if state:
        return _kind_of(state)(f"{text} (SQLSTATE {state})")
    if isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError)):
        if any(refusal in said for refusal in _LOGIN_REFUSALS):
            return StorageAccessDenied(text)
        return StorageUnavailable(f"PostgreSQL at {where} is unreachable: {said}")
    if not isinstance(error, psycopg.Error):  # the pool's timeout, a socket error
        return StorageUnavailable(f"PostgreSQL at {where} is unreachable: {said}")
    return StorageRefused(text)


def _one_line(text: str) -> str:
    """libpq's multi-line text (``LINE 1: ...``, a caret, a second host tried) on one line:
    it ends up in a log line, a status problem and the CLI's one-line reason."""
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def _kind_of(state: str) -> type[StorageError]:
    """The taxonomy's class for a SQLSTATE (see the module docstring)."""
    if state == _UNDEFINED_TABLE:
        return SchemaMissing
    if state in _ENDPOINT_STATES or state.startswith(_ENDPOINT_CLASSES):
        return StorageAccessDenied
    if state in _TRANSIENT_STATES or state.startswith(_TRANSIENT_CLASSES):
        return StorageUnavailable
    return StorageRefused


def discards_connection(error: Exception) -> bool:
    """True if the connection that met ``error`` must be closed rather than pooled again:
    after a failover it may still be connected to the old primary, now read-only, and
    waiting would never cure that."""
    return getattr(error, "sqlstate", None) in _DISCARDING_STATES


@contextmanager
def discarding(connection: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """Use a pooled ``connection``; close it (the pool then replaces it) when it met an
    error after which it must not be used again (:func:`discards_connection`)."""
    try:
        yield connection
    except psycopg.Error as exc:
        if discards_connection(exc):
            connection.close()
        raise


def is_privilege_refusal(error: BaseException) -> bool:
    """True if ``error`` (or what caused it) says the role lacks a privilege (``42501``)."""
    cause = error.__cause__ if error.__cause__ is not None else error
    return getattr(cause, "sqlstate", None) == "42501"


def login_problem(conninfo: str, timeout: float) -> StorageError | None:
    """Connect once outside the pool and classify the failure (``None``: it connected).
    The pool only reports a timeout, whatever the server said."""
    try:
        psycopg.connect(conninfo, connect_timeout=max(1, int(timeout))).close()
    except psycopg.Error as error:
        return classified(error, redact(conninfo))
    return None


#: What psycopg's pool logs at WARNING for each failed attempt to connect (the pool's
#: name is the first argument of each).
_POOL_ATTEMPT_LINES = frozenset({"error connecting in %r: %s",
                                 "reconnection attempt in pool %r failed after %s sec"})


class PoolAttempts(logging.Filter):
    """Keeps the WARNING psycopg's pool logs at every failed connection attempt of the pool
    ``pool_name`` (``psycopg.pool``: one every second or so, each with libpq's two-line
    text, for as long as the database is unreachable) off the logs: idembus classifies the
    failure and says it once (:func:`classified`), the endpoint logs the outage its own
    way. Each attempt is logged at DEBUG instead (logger ``idembus.storage.postgres_errors``),
    and counted in :attr:`attempts`. :meth:`attach` / :meth:`detach` put it on the
    ``psycopg.pool`` logger and take it off."""

    def __init__(self, pool_name: str) -> None:
        super().__init__()
        self.pool_name = pool_name
        #: Failed attempts held back so far.
        self.attempts = 0

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg not in _POOL_ATTEMPT_LINES or not args or args[0] != self.pool_name:
            return True
        self.attempts += 1
        log.debug("pool %s: %s", self.pool_name, _one_line(redact(record.getMessage())))
        return False

    def attach(self) -> None:
        logging.getLogger("psycopg.pool").addFilter(self)

    def detach(self) -> None:
        logging.getLogger("psycopg.pool").removeFilter(self)
