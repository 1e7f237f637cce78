"""No password reaches any output. Each failure case runs the real command line in its own
process with a distinctive password in its connection string, and every byte it writes to
stdout and stderr (logs, tracebacks, error lines) is searched for the password."""

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
from collections.abc import Iterator

import pytest

from idembus.gateway.server import _unavailable
from idembus.storage.errors import StorageUnavailable
from tests.conftest import AMQP_URL, require_service

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECRET = "Zq7-S3cret-Never-Shown"

APP = textwrap.dedent('''
    import os

    from idembus import Endpoint
    from idembus.storage.memory import MemoryStorage
    from idembus.storage.postgres import PostgresStorage
    from tests.support import AccountHandler


    def endpoint() -> Endpoint:
        storage = os.environ.get("APP_POSTGRES")
        return Endpoint(
            "secrets-app",
            transport=os.environ.get("APP_TRANSPORT", "memory://"),
            storage=PostgresStorage(storage, connect_timeout=1) if storage else MemoryStorage(),
            handlers=[AccountHandler],
        )
''')


def idembus(tmp_path: pathlib.Path, *args: str, timeout: float = 30.0,
            **environment: str) -> tuple[int | None, str]:
    """Run ``idembus ARGS`` on the app configured by ``environment``; stop it with SIGTERM
    if it still runs after ``timeout`` s (an endpoint that keeps trying). Its exit status
    and everything it wrote."""
    (tmp_path / "secrets_app.py").write_text(APP)
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", *args], cwd=tmp_path, text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", **environment},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, errors="replace")
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    return process.returncode, out


def with_password(url: str, password: str = SECRET) -> str:
    """``url`` with its userinfo's password replaced (or added)."""
    scheme, rest = url.split("://", 1)
    userinfo, _, host = rest.rpartition("@")
    user = userinfo.split(":", 1)[0] if userinfo else ""
    return f"{scheme}://{user}:{password}@{host or rest}"


@pytest.mark.parametrize("conninfo", [
    f"postgresql://app:{SECRET}@127.0.0.1:1/test",
    f"host=127.0.0.1 port=1 user=app password='{SECRET} with spaces' dbname=test",
], ids=["url", "key-value"])
@pytest.mark.parametrize("command", ["run", "status", "migrate"])
def test_an_unreachable_database_never_shows_its_password(
    tmp_path: pathlib.Path, conninfo: str, command: str,
) -> None:
    status, out = idembus(tmp_path, command, "secrets_app:endpoint", APP_POSTGRES=conninfo)
    assert status not in (0, None), out
    assert "PostgreSQL" in out
    assert SECRET not in out


@pytest.mark.amqp
@pytest.mark.parametrize("command", [("run",), ("errors", "list")], ids=["run", "errors"])
def test_a_refused_broker_login_never_shows_its_password(
    tmp_path: pathlib.Path, command: tuple[str, ...],
) -> None:
    require_service(AMQP_URL, "RabbitMQ")
    status, out = idembus(tmp_path, *command, "secrets_app:endpoint", timeout=15,
                          APP_TRANSPORT=with_password(AMQP_URL))
    assert "refused" in out.lower() or "ACCESS_REFUSED" in out, out
    assert SECRET not in out


@pytest.fixture
def redis_with_password(tmp_path: pathlib.Path) -> Iterator[str]:
    """A Redis server of this test's own that requires a password (not the one given)."""
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
        yield f"redis://:{SECRET}@127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_redis_password_the_server_refuses_is_never_shown(
    tmp_path: pathlib.Path, redis_with_password: str,
) -> None:
    status, out = idembus(tmp_path, "errors", "list", "secrets_app:endpoint", timeout=15,
                          APP_TRANSPORT=redis_with_password)
    assert status != 0 and "refused this endpoint" in out, out
    assert SECRET not in out


def test_the_gateway_answer_when_the_storage_is_down_has_no_password() -> None:
    body = _unavailable(StorageUnavailable(
        f"PostgreSQL at postgresql://app:{SECRET}@db/x is unreachable"))
    assert "postgresql://app:***@db/x" in body["error"]
    assert SECRET not in str(body)
