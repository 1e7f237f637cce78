"""`idembus gateway` refuses what would serve nothing or leak the password — a journal no
other process can write, credentials on the command line or empty — with exit status 2 and
the reason; it reads its credentials from a file or the environment."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import uuid

import httpx
import pytest

from idembus.storage.postgres import PostgresStorage
from tests.conftest import POSTGRES_URL, require_service

ROOT = pathlib.Path(__file__).resolve().parent.parent
PASSWORD = "Qx4Never;Shown"

APP = textwrap.dedent('''
    import os

    from idembus import Endpoint
    from idembus.storage.memory import MemoryStorage
    from idembus.storage.postgres import PostgresStorage


    def endpoint() -> Endpoint:
        url = os.environ.get("APP_POSTGRES")
        storage = (PostgresStorage(url, table_prefix=os.environ["APP_PREFIX"]) if url
                   else MemoryStorage())
        return Endpoint("gateway-app", storage=storage,
                        transport=os.environ.get("APP_TRANSPORT", "memory://"), journal=True)
''')


def gateway(directory: pathlib.Path, *arguments: str, **environment: str,
            ) -> subprocess.Popen[str]:
    (directory / "gateway_app.py").write_text(APP)
    env = {key: value for key, value in os.environ.items() if key != "IDEMBUS_GATEWAY_AUTH"}
    return subprocess.Popen(
        [sys.executable, "-m", "idembus", "gateway", "gateway_app:endpoint",
         "--listen", "127.0.0.1:0", *arguments],
        cwd=directory, env={**env, "PYTHONPATH": str(ROOT), **environment},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def refused(directory: pathlib.Path, *arguments: str, **environment: str) -> str:
    """What a refused run said (it must exit 2 without serving)."""
    process = gateway(directory, *arguments, **environment)
    out, errors = process.communicate(timeout=60)
    assert process.returncode == 2, (out, errors)
    assert "idembus gateway:" not in out  # it never served
    return errors


def test_a_journal_in_a_process_local_storage_is_refused_instead_of_served_empty(
    tmp_path: pathlib.Path,
) -> None:
    said = refused(tmp_path)
    assert "storage of endpoint 'gateway-app' (MemoryStorage) is process-local" in said
    assert "would serve an empty stream" in said


def test_consuming_a_process_local_queue_is_refused(tmp_path: pathlib.Path) -> None:
    said = refused(tmp_path, "--consume")
    assert "transport of endpoint 'gateway-app' (KombuTransport) is process-local" in said
    assert "--consume would receive nothing" in said


def test_a_password_on_the_command_line_is_refused_and_not_repeated(
    tmp_path: pathlib.Path,
) -> None:
    said = refused(tmp_path, "--auth", f"reader:{PASSWORD}")
    assert "--auth puts the password where every user of this machine can read it" in said
    assert "IDEMBUS_GATEWAY_AUTH" in said and "--auth-file" in said
    assert "Qx4Never" not in said


@pytest.mark.parametrize(("value", "reason"), [
    ("reader:", "no password"), ("", "no colon"), (":pw", "no user")])
def test_empty_credentials_in_the_environment_are_refused(
    tmp_path: pathlib.Path, value: str, reason: str,
) -> None:
    said = refused(tmp_path, IDEMBUS_GATEWAY_AUTH=value)
    assert f"$IDEMBUS_GATEWAY_AUTH must be 'user:password' with neither part empty ({reason})" \
        in said


def test_an_auth_file_that_cannot_be_read_is_refused(tmp_path: pathlib.Path) -> None:
    said = refused(tmp_path, "--auth-file", str(tmp_path / "missing"))
    assert "--auth-file" in said and "cannot read it (No such file or directory)" in said


@pytest.mark.postgres
def test_credentials_from_a_file_guard_the_stream_and_the_status_not_the_health_check(
    tmp_path: pathlib.Path,
) -> None:
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"gwc{uuid.uuid4().hex[:10]}"
    secret = tmp_path / "gateway.auth"
    secret.write_text(f"reader:{PASSWORD}\n")
    secret.chmod(0o600)
    process = gateway(tmp_path, "--auth-file", str(secret), APP_POSTGRES=POSTGRES_URL,
                      APP_PREFIX=prefix)
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        assert " on http://127.0.0.1:" in banner, process.stderr.read() if process.stderr else ""
        url = banner.rsplit(" on ", 1)[1].strip()
        assert httpx.get(url + "/healthz").json() == {"status": "ok"}
        assert httpx.get(url + "/status").status_code == 401
        assert httpx.get(url + "/", headers={"Accept": "text/event-stream"}).status_code == 401
        status = httpx.get(url + "/status", auth=("reader", PASSWORD))
        assert status.status_code == 200 and status.json()["max_clients"] == 1000
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        _, errors = process.communicate()
        storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
        storage.drop_tables()
        storage.close()
    assert "Qx4Never" not in errors


def test_the_command_line_loads_without_the_web_libraries_and_names_the_extra_they_need(
) -> None:
    hide = ("import sys; sys.modules['starlette'] = None; "
            "from idembus.cli import main; import idembus.gateway.request; ")
    loaded = subprocess.run(
        [sys.executable, "-c", hide + "sys.exit(main(['gateway', 'app:endpoint']))"],
        capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 2, loaded.stderr
    assert "idembus gateway needs starlette: pip install 'idembus[web]'" in loaded.stderr
    imported = subprocess.run(
        [sys.executable, "-c", hide + "from idembus.gateway import Gateway"],
        capture_output=True, text=True, timeout=60)
    assert "the event gateway needs starlette: pip install 'idembus[web]'" in imported.stderr
