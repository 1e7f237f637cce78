"""`idembus run package.module:endpoint` runs an endpoint until SIGTERM."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

from idembus import ConfigurationError
from idembus.runtime.loading import load_endpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent

APP = textwrap.dedent('''
    from idembus import Endpoint
    from idembus.handlers import Handler, handles
    from idembus.storage.memory import MemoryStorage
    from tests.support import Deposit


    class Announce(Handler):
        @handles
        def on(self, message: Deposit) -> None:
            print("handled", message.account, flush=True)


    def make() -> Endpoint:
        endpoint = Endpoint("cli-app", storage=MemoryStorage(), handlers=[Announce])
        endpoint.transport.declare(endpoint.name)
        endpoint.bus.send(Deposit(account="from-cli", amount=1))  # waits in memory://
        return endpoint

    not_an_endpoint = 42
    a_class = Announce
''')


@pytest.fixture
def app_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "cli_app.py").write_text(APP)
    return tmp_path


def idembus(*args: str, cwd: pathlib.Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "idembus", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def handles_then_stops_on_sigterm(process: subprocess.Popen[str]) -> None:
    """The app's waiting message is handled, and SIGTERM ends the run with exit 0."""
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "handled from-cli"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        process.kill()
        process.communicate()


def test_run_handles_messages_and_stops_with_exit_0_on_sigterm(app_dir):
    handles_then_stops_on_sigterm(idembus("run", "cli_app:make", cwd=app_dir))


@pytest.mark.parametrize(
    ("reference", "complaint"),
    [
        ("cli_app", "is not of the form package.module:endpoint"),
        ("missing_module:x", "cannot import 'missing_module'"),
        ("cli_app:nothing", "module 'cli_app' has no attribute 'nothing'"),
        ("cli_app:not_an_endpoint", "is a int, not an Endpoint"),
        ("cli_app:a_class", "is the class Announce, not an Endpoint"),
    ],
)
def test_run_explains_a_bad_reference_and_exits_2(app_dir, reference, complaint):
    process = idembus("run", reference, cwd=app_dir)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2
    assert complaint in stderr


def test_load_endpoint_refuses_what_is_not_an_endpoint(app_dir, monkeypatch):
    monkeypatch.chdir(app_dir)
    monkeypatch.syspath_prepend(str(app_dir))
    with pytest.raises(ConfigurationError, match="not an Endpoint"):
        load_endpoint("cli_app:not_an_endpoint")


def test_the_idembus_command_is_installed():
    script = pathlib.Path(sys.executable).parent / "idembus"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    assert "run" in done.stdout


def test_app_dir_says_where_the_app_lives(app_dir, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    handles_then_stops_on_sigterm(
        idembus("run", "cli_app:make", "--app-dir", str(app_dir), cwd=elsewhere))


#: Modules of the user's named like libraries the command line imports, in the working
#: directory: none may be imported instead of the library.
SHADOWS = ("kombu", "psycopg", "json")


def shadowing_modules(directory: pathlib.Path) -> None:
    for name in SHADOWS:
        (directory / f"{name}.py").write_text(
            f"raise ImportError('the user module {name}.py was imported')\n")


def test_python_dash_m_idembus_imports_no_module_of_the_working_directory_for_a_library(
    app_dir,
):
    # Given files named like libraries next to the app (which imports psycopg's storage)
    shadowing_modules(app_dir)
    (app_dir / "cli_app.py").write_text(
        "import idembus.storage.postgres  # noqa: F401  (imports psycopg)\n" + APP)

    # When `python -m idembus run` starts there
    process = idembus("run", "cli_app:make", cwd=app_dir)

    # Then it runs the app (found in the working directory, after the installed packages)
    # with the real libraries
    try:
        assert process.stdout is not None
        handled = process.stdout.readline().strip()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
    finally:
        process.kill()
    assert "the user module" not in stderr, stderr
    assert handled == "handled from-cli" and process.returncode == 0, stderr


def test_a_module_not_found_from_another_folder_suggests_app_dir(app_dir, tmp_path_factory):
    # Given a command run from a folder that does not hold the app
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    process = idembus("errors", "list", "cli_app:make", cwd=elsewhere)
    _, stderr = process.communicate(timeout=30)
    # Then it says where it looked and how to say where the app is
    assert process.returncode == 2
    assert "No module named 'cli_app'" in stderr
    assert f"working directory {elsewhere}" in stderr and "--app-dir FOLDER" in stderr


def test_a_module_that_imports_something_missing_is_not_told_about_app_dir(
    app_dir, monkeypatch
):
    (app_dir / "broken_app.py").write_text("import not_installed_anywhere\n")
    monkeypatch.chdir(app_dir)
    monkeypatch.syspath_prepend(str(app_dir))
    with pytest.raises(ConfigurationError, match="No module named 'not_installed_anywhere'") \
            as raised:
        load_endpoint("broken_app:make")
    assert "--app-dir" not in str(raised.value)
