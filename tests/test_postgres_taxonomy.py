"""PostgreSQL's refusals sorted by the failure taxonomy, offline: each SQLSTATE is raised as
psycopg raises it (the class ``psycopg.errors.lookup`` gives), with no server. What the
server really sends for the cheap cases is in ``test_postgres_failures``."""

from __future__ import annotations

import psycopg
import psycopg.errors
import pytest
from psycopg_pool import PoolTimeout

from idembus.storage.errors import (
    SchemaMissing,
    StorageAccessDenied,
    StorageRefused,
    StorageUnavailable,
)
from idembus.storage.postgres_errors import classified, discards_connection

WAIT, ENDPOINT, MESSAGE = StorageUnavailable, StorageAccessDenied, StorageRefused

SQLSTATES = {
    # transient: the database is away, busy, restarting or failing over
    "08006": (WAIT, "connection failure"),
    "08001": (WAIT, "cannot establish a connection"),
    "40001": (WAIT, "serialization failure"),
    "40P01": (WAIT, "deadlock detected"),
    "53100": (WAIT, "disk full"),
    "53200": (WAIT, "out of memory"),
    "53300": (WAIT, "too many connections"),
    "57000": (WAIT, "operator intervention"),
    "57014": (WAIT, "statement_timeout, or a cancel"),
    "57P01": (WAIT, "administrator shutdown"),
    "57P02": (WAIT, "crash shutdown"),
    "57P03": (WAIT, "the database system is starting up"),
    "57P05": (WAIT, "idle session timeout"),
    "55P03": (WAIT, "lock_timeout"),
    "25P03": (WAIT, "idle-in-transaction session timeout"),
    "25006": (WAIT, "read-only transaction: a standby after a failover"),
    "58030": (WAIT, "I/O error"),
    "72000": (WAIT, "snapshot too old"),
    # permanent for the endpoint: only an operator cures it
    "28000": (ENDPOINT, "role not allowed to log in"),
    "28P01": (ENDPOINT, "wrong password"),
    "3D000": (ENDPOINT, "no such database"),
    "3F000": (ENDPOINT, "no such schema"),
    "42501": (ENDPOINT, "privilege missing"),
    "42P01": (SchemaMissing, "table missing: not migrated"),  # a StorageAccessDenied
    "42703": (ENDPOINT, "column missing: an older schema"),
    "42804": (ENDPOINT, "a column of another type"),
    "42883": (ENDPOINT, "a function the server lacks"),
    "0A000": (ENDPOINT, "a feature the server lacks"),
    "57P04": (ENDPOINT, "the database was dropped"),
    "XX001": (ENDPOINT, "data corrupted"),
    "XX002": (ENDPOINT, "index corrupted"),
    # permanent for this message: its own data
    "22001": (MESSAGE, "string too long"),
    "22021": (MESSAGE, "a character not in the encoding"),
    "22P02": (MESSAGE, "invalid text representation"),
    "22P05": (MESSAGE, "a NUL in jsonb"),
    "23502": (MESSAGE, "not-null violation"),
    "23505": (MESSAGE, "unique violation outside a commit"),
    "23514": (MESSAGE, "check violation"),
    "54000": (MESSAGE, "an index row too large (an OperationalError in psycopg)"),
    "54001": (MESSAGE, "statement too complex"),
}


@pytest.mark.parametrize("sqlstate", sorted(SQLSTATES))
def test_each_sqlstate_is_classified_by_the_taxonomy(sqlstate: str) -> None:
    expected, meaning = SQLSTATES[sqlstate]
    error = psycopg.errors.lookup(sqlstate)(meaning)

    found = classified(error, "db.example:5432")

    assert type(found) is expected, f"{sqlstate} ({meaning}, {type(error).__name__})"
    assert f"SQLSTATE {sqlstate}" in str(found)


def test_the_sqlstate_decides_where_psycopg_classes_disagree_with_the_taxonomy() -> None:
    # psycopg files a program limit with lost connections, a read-only standby with bugs
    limit, read_only = psycopg.errors.lookup("54000"), psycopg.errors.lookup("25006")
    assert issubclass(limit, psycopg.OperationalError)
    assert issubclass(read_only, psycopg.InternalError)

    assert type(classified(limit("index row too large"), "db")) is StorageRefused
    assert type(classified(read_only("read-only transaction"), "db")) is StorageUnavailable


@pytest.mark.parametrize("error, expected", [
    (psycopg.OperationalError('connection failed: connection to server at "db", port 5432 '
                              'failed: FATAL:  role "app" is not permitted to log in'),
     StorageAccessDenied),
    (psycopg.OperationalError('connection failed: FATAL:  password authentication failed '
                              'for user "app"'), StorageAccessDenied),
    (psycopg.OperationalError('connection failed: FATAL:  pg_hba.conf rejects connection '
                              'for host "10.0.0.5", user "app", database "sales"'),
     StorageAccessDenied),
    (psycopg.OperationalError('connection failed: FATAL:  database "sales" does not exist'),
     StorageAccessDenied),
    (psycopg.OperationalError("consuming input failed: server closed the connection "
                              "unexpectedly"), StorageUnavailable),
    (psycopg.OperationalError('connection failed: FATAL:  sorry, too many clients already'),
     StorageUnavailable),
    (psycopg.OperationalError('connection failed: FATAL:  the database system is starting '
                              'up'), StorageUnavailable),
    (psycopg.errors.ConnectionTimeout("connection timeout expired"), StorageUnavailable),
    (psycopg.InterfaceError("the connection is closed"), StorageUnavailable),
    (PoolTimeout("couldn't get a connection after 5.00 sec"), StorageUnavailable),
    (ConnectionResetError("connection reset by peer"), StorageUnavailable),
    (psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
     StorageRefused),
], ids=["nologin", "password", "pg_hba-reject", "no-database", "closed", "too-many-clients",
        "starting-up", "connect-timeout", "interface", "pool-timeout", "socket", "nul-text"])
def test_errors_without_a_sqlstate_are_classified_by_psycopg_class_and_libpq_text(
    error: Exception, expected: type[Exception],
) -> None:
    assert type(classified(error, "db")) is expected


def test_a_reason_spread_over_several_lines_by_libpq_is_reported_on_one() -> None:
    error = psycopg.errors.lookup("42804")(
        "argument of WHERE must be type boolean, not type text\n"
        "LINE 2:  ON t (processed_at) WHERE dispatched\n"
        "                                   ^")

    reason = str(classified(error, "db"))

    assert "\n" not in reason
    assert "WHERE dispatched" in reason and "42804" in reason


def test_a_refusal_carries_no_password() -> None:
    error = psycopg.errors.lookup("28P01")(
        "password authentication failed (postgresql://app:hunter22@db/sales)")

    assert "hunter22" not in str(classified(error, "postgresql://app:hunter22@db/sales"))


@pytest.mark.parametrize("conninfo", [
    "postgresql://app:hunter22@10.0.0.1:5432,10.0.0.2:5432/sales"
    "?target_session_attrs=read-write",
    "host=10.0.0.1,10.0.0.2 port=5432,5432 password=hunter22 target_session_attrs=read-write",
])
def test_a_pair_that_has_no_primary_yet_is_an_outage_that_names_no_password(
    conninfo: str,
) -> None:
    # libpq's words when each host of a multi-host conninfo refused: one dead, one a
    # standby not promoted yet
    error = psycopg.OperationalError(
        'connection failed: connection to server at "10.0.0.2", port 5432 failed: session '
        "is read-only\nMultiple connection attempts failed. All failures were:\n- host: "
        "'10.0.0.1', port: '5432', hostaddr: '10.0.0.1': connection failed: Connection "
        "refused\n- host: '10.0.0.2', port: '5432', hostaddr: '10.0.0.2': connection "
        "failed: session is read-only")

    found = classified(error, conninfo)

    assert type(found) is StorageUnavailable
    assert "hunter22" not in str(found) and "\n" not in str(found)
    assert "10.0.0.1" in str(found) and "10.0.0.2" in str(found)


@pytest.mark.parametrize("sqlstate, discarded", [
    ("25006", True), ("57014", False), ("55P03", False), ("22P05", False),
])
def test_only_a_connection_that_may_be_attached_to_a_standby_is_discarded(
    sqlstate: str, discarded: bool,
) -> None:
    assert discards_connection(psycopg.errors.lookup(sqlstate)("refused")) is discarded


def test_a_missing_table_is_schema_missing_a_refusal_of_the_endpoint() -> None:
    found = classified(psycopg.errors.lookup("42P01")('relation "x_parked" does not exist'),
                       "db.example:5432")
    assert isinstance(found, SchemaMissing) and isinstance(found, StorageAccessDenied)
