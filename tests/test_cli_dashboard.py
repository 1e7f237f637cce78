"""`idembus dashboard` refuses, with exit status 2 and what to write instead, what would be
unsafe or show nothing: no credentials on a non-loopback address (the pages retry and
purge), a password on the command line, endpoints whose storage or broker another process
cannot see. (The browser test, tests/test_dashboard_browser.py, runs it serving.)"""

from __future__ import annotations

import sys
import types

import pytest

from idembus import Endpoint
from idembus.cli import main
from idembus.cli.supervisor import EXIT_CONFIGURATION
from idembus.storage.memory import MemoryStorage
from tests.test_cli_errors import SharedMemoryStorage

PASSWORD = "Never;Shown-42"


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A module ``dash_cli_app`` with endpoints on process-local parts."""
    module = types.ModuleType("dash_cli_app")
    module.local_storage = lambda: Endpoint(  # type: ignore[attr-defined]
        "local-storage", storage=MemoryStorage())
    module.local_broker = lambda: Endpoint(  # type: ignore[attr-defined]
        "local-broker", storage=SharedMemoryStorage())
    monkeypatch.setitem(sys.modules, "dash_cli_app", module)
    monkeypatch.delenv("IDEMBUS_GATEWAY_AUTH", raising=False)
    return module


def refused(capsys: pytest.CaptureFixture[str], *arguments: str) -> str:
    status = main(["dashboard", *arguments])
    out, errors = capsys.readouterr()
    assert status == EXIT_CONFIGURATION, (out, errors)
    assert "idembus dashboard:" not in out  # it never served
    return errors


def test_listening_beyond_loopback_without_credentials_is_refused_with_what_to_write(
    app: types.ModuleType, capsys: pytest.CaptureFixture[str],
) -> None:
    said = refused(capsys, "dash_cli_app:local_broker", "--listen", "0.0.0.0:0")
    assert "retries and purges messages" in said
    assert "IDEMBUS_GATEWAY_AUTH" in said and "--auth-file" in said and "127.0.0.1" in said


def test_a_password_on_the_command_line_is_refused_and_not_repeated(
    app: types.ModuleType, capsys: pytest.CaptureFixture[str],
) -> None:
    said = refused(capsys, "dash_cli_app:local_broker", "--auth", f"admin:{PASSWORD}")
    assert "IDEMBUS_GATEWAY_AUTH" in said and PASSWORD not in said


@pytest.mark.parametrize(("reference", "unseen"), [
    ("dash_cli_app:local_storage", "status reports, aggregates and journal"),
    ("dash_cli_app:local_broker", "error queue"),
])
def test_an_endpoint_another_process_cannot_see_is_refused(
    app: types.ModuleType, capsys: pytest.CaptureFixture[str], reference: str, unseen: str,
) -> None:
    said = refused(capsys, reference, "--listen", "127.0.0.1:0")
    assert "process-local" in said and unseen in said
