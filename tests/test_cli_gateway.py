"""`idembus gateway package.module:endpoint`: the event stream served by another process,
over PostgreSQL, read with httpx."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import httpx
import pytest

from idembus import Endpoint
from idembus.storage.postgres import PostgresStorage
from tests.conftest import POSTGRES_URL, require_service
from tests.sse_client import events, take
from tests.support import Account, Deposited

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def app(tmp_path: pathlib.Path) -> Iterator[tuple[pathlib.Path, str]]:
    """A module naming an endpoint on a fresh PostgreSQL prefix, and that prefix."""
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"gw{uuid.uuid4().hex[:10]}"
    (tmp_path / "gateway_app.py").write_text(textwrap.dedent(f'''
        from idembus import Endpoint
        from idembus.storage.postgres import PostgresStorage
        from tests.support import AccountHandler

        endpoint = Endpoint("gw-{prefix}", storage=PostgresStorage({POSTGRES_URL!r},
                            table_prefix={prefix!r}), handlers=[AccountHandler], journal=True)
    '''))
    yield tmp_path, prefix


def start_gateway(directory: pathlib.Path, *arguments: str,
                  env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "idembus", "gateway", "gateway_app:endpoint", *arguments],
        cwd=directory, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.postgres
def test_the_gateway_command_streams_the_journal_of_another_process_and_stops_on_sigterm(
    app: tuple[pathlib.Path, str],
) -> None:
    directory, prefix = app
    publisher = Endpoint(f"gw-{prefix}", storage=PostgresStorage(POSTGRES_URL, table_prefix=prefix),
                         journal=True)
    publisher.storage.migrate()

    def deposit(account: str) -> str:
        with publisher.unit_of_work(Account, account) as work:
            work.state.balance += 1
            return work.bus.publish(Deposited(account=account, amount=1))

    first = deposit("a")
    process = start_gateway(directory, "--listen", "127.0.0.1:0",
                            env={"IDEMBUS_GATEWAY_AUTH": "ops:pw"})
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        assert " on http://127.0.0.1:" in banner, process.stderr.read() if process.stderr else ""
        url = banner.rsplit(" on ", 1)[1].strip()
        assert httpx.get(url + "/status").status_code == 401
        with httpx.Client(auth=("ops", "pw"), timeout=15.0) as client:
            with client.stream("GET", url + "/", headers={"Accept": "text/event-stream",
                                                           "Last-Event-ID": "0"}) as response:
                received = events(response)
                reset, state, live = take(received, 3)
                later = [deposit("b"), deposit("a")]
                after = take(received, 2)
            status = client.get(url + "/status").json()
        assert reset.kind == "reset"
        assert (state.kind, state.data["aggregate_id"], state.data["state"]["balance"]) == (
            "Account", "a", 1)
        assert (live.kind, live.id) == ("live", "1")
        assert [event.id for event in after] == ["2", "3"]
        assert [event.data["headers"]["idembus.message_id"] for event in after] == later
        assert first not in later
        assert status["journal"]["newest"] == 3 and status["replications"] == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
        publisher.close()


@pytest.mark.postgres
def test_a_bad_listen_address_fails_at_start_with_what_to_fix(
    app: tuple[pathlib.Path, str],
) -> None:
    directory, _ = app
    process = start_gateway(directory, "--listen", "8042")
    _, errors = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "--listen '8042': give host:port" in errors


@pytest.mark.postgres
def test_listening_beyond_loopback_without_credentials_fails_at_start_with_what_to_set(
    app: tuple[pathlib.Path, str],
) -> None:
    directory, _ = app
    environment = {key: value for key, value in os.environ.items()
                   if key != "IDEMBUS_GATEWAY_AUTH"}
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", "gateway", "gateway_app:endpoint",
         "--listen", "0.0.0.0:0"],
        cwd=directory, env={**environment, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # it serves: the refusal is missing
            process.kill()
            process.communicate()
    assert process.returncode == 2, (out, errors)
    assert "idembus gateway:" not in out  # it never served
    assert "loopback" in errors and "IDEMBUS_GATEWAY_AUTH" in errors
    assert "--auth-file" in errors


@pytest.mark.postgres
def test_idle_connections_beyond_the_descriptor_limit_neither_lock_clients_out_nor_flood_the_log(
    app: tuple[pathlib.Path, str],
) -> None:
    # Given a gateway process that may open 128 descriptors, with a long idle timeout
    directory, _ = app
    limited = ("import resource, sys; "
               "resource.setrlimit(resource.RLIMIT_NOFILE, "
               "(128, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
               "from idembus.cli import main; sys.exit(main(sys.argv[1:]))")
    process = subprocess.Popen(
        [sys.executable, "-c", limited, "gateway", "gateway_app:endpoint",
         "--listen", "127.0.0.1:0", "--idle-timeout", "120"],
        cwd=directory, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    idle: list[socket.socket] = []
    try:
        assert process.stdout is not None
        url = process.stdout.readline().rsplit(" on ", 1)[1].strip()
        host, port = url.removeprefix("http://").rsplit(":", 1)

        # When 300 connections open and send nothing
        for _ in range(300):
            idle.append(socket.create_connection((host, int(port)), timeout=5))

        # Then a new client is answered at once, not after the idle timeout
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        process.send_signal(signal.SIGTERM)
        _, errors = process.communicate(timeout=60)
        assert process.returncode == 0
        # And the log said so in a few lines, without a traceback
        assert "Traceback" not in errors, errors[-3000:]
        assert len(errors.splitlines()) < 20, errors[:2000]
    finally:
        for connection in idle:
            connection.close()
        if process.poll() is None:
            process.kill()
            process.communicate()
