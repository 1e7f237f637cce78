"""``idembus run`` on PostgreSQL when the database refuses the start for a reason only an
operator can cure: it exits with status 2 and one line saying why, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import psycopg
import pytest

from idembus.storage.postgres import PostgresStorage
from tests.conftest import POSTGRES_URL, require_service

pytestmark = pytest.mark.postgres

APP = '''
from idembus import Endpoint
from idembus.storage.postgres import PostgresStorage


def endpoint():
    return Endpoint({name!r}, transport="memory://", storage=PostgresStorage(
        {conninfo!r}, table_prefix={prefix!r}, connect_timeout=1))
'''


def as_role(url: str, role: str, password: str | None = None) -> str:
    """``url`` logging in as ``role`` (with ``password``)."""
    parts = urlparse(url)
    login = role if password is None else f"{role}:{password}"
    host = parts.hostname or "127.0.0.1"
    return urlunparse(parts._replace(netloc=f"{login}@{host}:{parts.port or 5432}"))


def idembus_run(app_dir: Path, conninfo: str, prefix: str) -> subprocess.CompletedProcess[str]:
    """``idembus run`` of an endpoint on ``conninfo``, in a process of its own."""
    module = f"pg_start_{uuid.uuid4().hex[:8]}"
    (app_dir / f"{module}.py").write_text(APP.format(
        name=f"pg-start-{prefix}", conninfo=conninfo, prefix=prefix))
    return subprocess.run(
        [sys.executable, "-m", "idembus", "run", f"{module}:endpoint", "--app-dir",
         str(app_dir)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False)


def reason_of(stderr: str) -> str:
    """The one line ``idembus`` ends with; fails if the reason is not alone on it."""
    assert "Traceback" not in stderr
    reasons = [line for line in stderr.splitlines() if line.startswith("idembus: ")]
    assert len(reasons) == 1, stderr
    assert stderr.rstrip().splitlines()[-1] == reasons[0], "the reason spans several lines"
    return reasons[0]


@pytest.fixture
def nologin_role() -> Iterator[str]:
    """A role the server does not let log in."""
    require_service(POSTGRES_URL, "PostgreSQL")
    role = f"idembus_nologin_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} NOLOGIN")
    yield role
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize("kind", ["unknown role", "role not permitted to log in"])
def test_a_refused_login_stops_the_start_with_status_2_and_one_line(
    kind: str, nologin_role: str, tmp_path: Path,
) -> None:
    # Given an endpoint whose database refuses its login (this server trusts local
    # logins, so a wrong password would be let in: the role itself is refused)
    if kind == "unknown role":
        role, reason = f"idembus_nobody_{uuid.uuid4().hex[:8]}", "does not exist"
    else:
        role, reason = nologin_role, "not permitted to log in"
    conninfo = as_role(POSTGRES_URL, role, "s3cret-pw")

    # When it is run
    done = idembus_run(tmp_path, conninfo, f"ps{uuid.uuid4().hex[:10]}")

    # Then it exits with status 2 (a configuration error: running again would not help)
    # and one line that says why, without the password
    line = reason_of(done.stderr)
    assert reason in line and role in line
    assert "s3cret-pw" not in done.stderr
    assert done.returncode == 2, done.stderr


def test_a_table_in_the_way_stops_the_start_with_status_2_and_one_line(tmp_path: Path) -> None:
    # Given a database where a table with the endpoint's name, not made by idembus, has a
    # column of another type
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"ps{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {prefix}_processed (aggregate_type text, aggregate_id text,"
                      " key text, outgoing jsonb, outgoing_ids jsonb, dispatched text, "
                      "processed_at timestamptz)")
    try:
        # When the endpoint is run
        done = idembus_run(tmp_path, POSTGRES_URL, prefix)

        # Then it exits with status 2 and one line naming the table and what to do
        line = reason_of(done.stderr)
        assert f"{prefix}_processed" in line and "42804" in line and "table_prefix" in line
        assert done.returncode == 2, done.stderr
    finally:
        cleaner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
        cleaner.drop_tables()
        cleaner.close()


def test_an_unreachable_database_is_one_clear_line_without_the_pools_warnings(
    tmp_path: Path,
) -> None:
    # Given nothing listening where the endpoint's database should be
    unreachable = "postgresql://postgres:secret@127.0.0.1:1/nowhere"

    # When it is run
    done = idembus_run(tmp_path, unreachable, f"t_{uuid.uuid4().hex[:8]}")

    # Then it exits 1 (worth trying again) with one line, and psycopg's pool did not log
    # a WARNING at each attempt to connect while idembus found out
    assert done.returncode == 1, done.stderr
    assert "is unreachable" in reason_of(done.stderr) and "secret" not in done.stderr
    assert "error connecting" not in done.stderr and "psycopg.pool" not in done.stderr, \
        done.stderr
