"""No password reaches any output. Each failure case runs the real command line in its own
process with a distinctive password in its connection string, and every byte it writes —
stdout, stderr (logs, tracebacks, error lines) and any file it leaves in its directory — is
searched for every piece of the password.

The passwords are made of distinctive pieces joined by the punctuation that used to end a
masked value early (``; , ) ' &``): a redaction that stops at any of them leaves a piece
behind, and the search finds it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from idembus import Endpoint
from idembus.storage.errors import StorageUnavailable
from idembus.storage.memory import MemoryStorage
from tests.conftest import AMQP_URL, require_service

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Pieces no output has any other reason to contain.
PIECES = ("Zq7Alpha", "Xk8Bravo", "Wm9Charlie", "Vn0Delta", "Ut1Echo", "Sr2Foxtrot")
#: One password with every character that ended a masked value early: ``; , ) ' &``.
SECRET = "Zq7Alpha;Xk8Bravo,Wm9Charlie)Vn0Delta'Ut1Echo&Sr2Foxtrot"
#: :data:`SECRET` as an unquoted libpq value (its quote escaped).
ESCAPED_SECRET = SECRET.replace("'", "\\'")
#: With white space too, for the forms that can quote it.
SPACED_SECRET = "Zq7Alpha; Xk8Bravo, Wm9Charlie) Vn0Delta' Ut1Echo & Sr2Foxtrot"

APP = textwrap.dedent('''
    import os

    from idembus import Endpoint
    from idembus.storage.memory import MemoryStorage
    from idembus.storage.postgres import PostgresStorage
    from tests.support import AccountHandler


    class SharedStorage(MemoryStorage):
        """Stands in for a database processes share (``idembus errors`` refuses a
        process-local storage before it reads the broker)."""

        process_local = False


    def endpoint() -> Endpoint:
        if os.environ.get("APP_FAIL"):  # a bug, with a connection string in its message
            raise RuntimeError(f"cannot build the endpoint from {os.environ['APP_FAIL']}")
        storage = os.environ.get("APP_POSTGRES")
        return Endpoint(
            "secrets-app",
            transport=os.environ.get("APP_TRANSPORT", "memory://"),
            storage=PostgresStorage(storage, connect_timeout=1) if storage else SharedStorage(),
            handlers=[AccountHandler],
        )
''')


def idembus(tmp_path: pathlib.Path, *args: str, timeout: float = 30.0,
            **environment: str) -> tuple[int | None, str]:
    """Run ``idembus ARGS`` on the app configured by ``environment``; stop it with SIGTERM
    if it still runs after ``timeout`` s (an endpoint that keeps trying). Its exit status
    and everything it wrote, checked for the password on the way: stdout, stderr, and every
    file it left in its directory."""
    (tmp_path / "secrets_app.py").write_text(APP)
    before = set(tmp_path.rglob("*"))
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", *args], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", **environment},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    written = [path.read_bytes() for path in set(tmp_path.rglob("*")) - before
               if path.is_file() and "__pycache__" not in path.parts]
    for name, data in [("stdout", out), ("stderr", err), *(("a file", d) for d in written)]:
        assert_no_piece_of_the_password(data, name)
    return process.returncode, (out + err).decode("utf-8", "replace")


def assert_no_piece_of_the_password(data: bytes, where: str) -> None:
    """No piece of :data:`SECRET`, raw or percent-encoded, in any byte of ``data``."""
    for piece in PIECES:
        assert piece.encode() not in data, (
            f"{piece!r} of the password in {where}: {data.decode('utf-8', 'replace')}")


def with_password(url: str, *, raw: bool = False) -> str:
    """``url`` with :data:`SECRET` as its userinfo's password (replaced or added),
    percent-encoded as a URL wants it, or ``raw`` as an operator may write it (kombu then
    cuts the URL at the ``;``, a failover list, and fails to read its port)."""
    scheme, rest = url.split("://", 1)
    userinfo, _, host = rest.rpartition("@")
    user = userinfo.split(":", 1)[0] if userinfo else ""
    password = SECRET if raw else urllib.parse.quote(SECRET, safe="")
    return f"{scheme}://{user}:{password}@{host or rest}"


#: What a broker URL with the password refused says, percent-encoded or raw.
REFUSED = {False: "refused", True: "cannot be used"}


def libpq_quoted(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


@pytest.mark.parametrize("conninfo", [
    f"postgresql://app:{urllib.parse.quote(SECRET, safe='')}@127.0.0.1:1/test",
    f"postgresql://app@127.0.0.1:1/test?password={urllib.parse.quote(SECRET, safe='')}"
    "&connect_timeout=1",
    f"host=127.0.0.1 port=1 user=app password={ESCAPED_SECRET} dbname=test",
    f"host=127.0.0.1 port=1 user=app password = {libpq_quoted(SPACED_SECRET)} dbname=test",
], ids=["url", "url-query", "key-value", "key-value-quoted"])
@pytest.mark.parametrize("command", [
    ("run",), ("run", "--log-format", "json"), ("status",), ("migrate",), ("gateway",),
    ("dispatcher",),
], ids=lambda command: "-".join(part.strip("-") for part in command))
def test_an_unreachable_database_never_shows_its_password(
    tmp_path: pathlib.Path, conninfo: str, command: tuple[str, ...],
) -> None:
    status, out = idembus(tmp_path, command[0], "secrets_app:endpoint", *command[1:],
                          APP_POSTGRES=conninfo)
    assert status not in (0, None), out
    assert "PostgreSQL" in out


@pytest.mark.amqp
@pytest.mark.parametrize("raw", [False, True], ids=["percent-encoded", "raw"])
@pytest.mark.parametrize("command", [("run",), ("errors", "list")], ids=["run", "errors"])
def test_a_refused_broker_login_never_shows_its_password(
    tmp_path: pathlib.Path, command: tuple[str, ...], raw: bool,
) -> None:
    require_service(AMQP_URL, "RabbitMQ")
    status, out = idembus(tmp_path, *command, "secrets_app:endpoint", timeout=15,
                          APP_TRANSPORT=with_password(AMQP_URL, raw=raw))
    assert status != 0 and REFUSED[raw] in out.lower(), out
    if command[0] == "errors":  # a command that reads once: no retrying would help
        assert status == 2 and len(out.strip().splitlines()) == 1, out


@pytest.fixture
def redis_with_password(tmp_path: pathlib.Path) -> Iterator[str]:
    """The URL of a Redis server of this test's own that requires a password (not the one
    the test gives)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed: cannot start a Redis that refuses logins")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", "the-right-one",
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:  # a connect loop: the server process gives no other readiness signal
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.redis  # a Redis server of its own, from the redis-server that Redis installs
@pytest.mark.parametrize("raw", [False, True], ids=["percent-encoded", "raw"])
def test_a_redis_password_the_server_refuses_is_never_shown(
    tmp_path: pathlib.Path, redis_with_password: str, raw: bool,
) -> None:
    status, out = idembus(tmp_path, "errors", "list", "secrets_app:endpoint", timeout=15,
                          APP_TRANSPORT=with_password(redis_with_password, raw=raw))
    assert status == 2 and REFUSED[raw] in out.lower(), out
    assert len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("command", ["gateway", "dispatcher", "run", "status"])
def test_an_uncaught_exception_never_shows_a_password(tmp_path: pathlib.Path,
                                                      command: str) -> None:
    status, out = idembus(tmp_path, command, "secrets_app:endpoint",
                          APP_FAIL=f"host=db password={ESCAPED_SECRET}")
    assert status == 1 and "RuntimeError: cannot build the endpoint" in out, out
    assert "password=***" in out


class FailingJournal(MemoryStorage):
    """A journal that can be read until ``down``, then fails naming its URL."""

    down = False

    def journal_bounds(self) -> Any:
        if self.down:
            raise StorageUnavailable(
                f"PostgreSQL at postgresql://app:{SECRET}@db/x is unreachable")
        return super().journal_bounds()


def test_the_gateway_answer_when_the_storage_is_down_has_no_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import httpx

    from idembus.gateway import Gateway

    storage = FailingJournal()
    with Endpoint("secret-gateway", storage=storage, journal=True) as endpoint:
        gateway = Gateway(endpoint, port=0)
        gateway.start()
        try:
            storage.down = True
            answer = httpx.get(gateway.url + "/status", timeout=10)
        finally:
            gateway.stop(5)
    assert answer.status_code == 503
    assert_no_piece_of_the_password(answer.content, "the HTTP body")
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "postgresql://app:***@db/x" in logged
    assert_no_piece_of_the_password(logged.encode(), "the log")
