"""The failure taxonomy for PostgreSQL, decided from psycopg's own classes and SQLSTATE.

* *transient* (:class:`~storage.errors.StorageUnavailable`): the connection is lost or
  refused, the pool timed out, and SQLSTATE classes ``08`` (connection exception), ``53``
  (insufficient resources), ``57`` (operator intervention: shutdown, cancel, crash
  recovery) and ``40`` (serialization failure, deadlock): waited out with backoff;
* *permanent for the endpoint* (:class:`~storage.errors.StorageAccessDenied`): ``28``
  (login refused), ``42501`` (privilege missing), ``42P01`` (a table missing: migrations not
  run), ``3D000`` (no such database): logged at ERROR and retried until an operator acts;
* *permanent for this message* (:class:`~storage.errors.StorageRefused`): everything else
  the server or psycopg refuses — ``22`` data exceptions (a NUL character, a bad escape),
  ``23`` integrity, ``54`` program limits (an index row too large), psycopg's own
  ``DataError`` for text it cannot send. The message fails like any other and goes to the
  error queue after its retries.

A refused login reaches the pool as a timeout; :func:`login_problem` asks the server once
more, directly, to tell the two apart.
"""

from __future__ import annotations

import psycopg

from ..redaction import redact
from .errors import StorageAccessDenied, StorageError, StorageRefused, StorageUnavailable

_TRANSIENT_CLASSES = ("08", "53", "57", "40")
_ACCESS_CLASSES = ("28",)
_ACCESS_STATES = ("42501", "42P01", "3D000")
#: What libpq says (with no SQLSTATE) when the server refuses the login itself.
_LOGIN_REFUSALS = ("authentication failed", "no pg_hba.conf entry", "does not exist",
                   "permission denied", "password authentication", "no password supplied")


def classified(error: Exception, where: str) -> StorageError:
    """The storage error for ``error``, met while talking to the database ``where``."""
    state = getattr(error, "sqlstate", None) or ""
    text = f"PostgreSQL at {where}: {redact(str(error))}"
    if state.startswith(_ACCESS_CLASSES) or state in _ACCESS_STATES:
        return StorageAccessDenied(f"{text} (SQLSTATE {state})")
    if state.startswith(_TRANSIENT_CLASSES):
        return StorageUnavailable(f"{text} (SQLSTATE {state})")
    if isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError)) and not state:
        if any(refusal in str(error) for refusal in _LOGIN_REFUSALS):
            return StorageAccessDenied(text)
        return StorageUnavailable(f"PostgreSQL at {where} is unreachable: {redact(str(error))}")
    if not isinstance(error, psycopg.Error):  # the pool's timeout, a socket error
        return StorageUnavailable(f"PostgreSQL at {where} is unreachable: {redact(str(error))}")
    suffix = f" (SQLSTATE {state})" if state else ""
    return StorageRefused(f"{text}{suffix}")


def login_problem(conninfo: str, timeout: float) -> StorageError | None:
    """Connect once outside the pool and classify the failure (``None``: it connected).
    The pool only reports a timeout, whatever the server said."""
    try:
        psycopg.connect(conninfo, connect_timeout=max(1, int(timeout))).close()
    except psycopg.Error as error:
        return classified(error, redact(conninfo))
    return None
