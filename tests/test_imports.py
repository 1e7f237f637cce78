"""One namespace, idembus: its packages import on their own, in any order, without side
effects; the wheel's layout maps the card's folders onto it; a user's own modules named
like idembus's folders never shadow them."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest

import idembus
import idembus.handlers
import idembus.storage
import idembus.transports

PACKAGES = ["idembus", "idembus.handlers", "idembus.storage", "idembus.transports"]


def run(code: str, **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, **options)  # type: ignore[call-overload]


@pytest.mark.parametrize("first", PACKAGES)
def test_each_package_imports_first_in_a_fresh_interpreter(first: str) -> None:
    done = run(f"import {first}; import {', '.join(PACKAGES)}; print(idembus.Endpoint)")
    assert done.returncode == 0, done.stderr
    assert "idembus.runtime.endpoint.Endpoint" in done.stdout


def test_importing_idembus_does_not_import_brokers_or_databases() -> None:
    done = run("import sys, idembus; heavy = [m for m in ('kombu', 'pymongo', 'mongomock', "
               "'psycopg') if m in sys.modules]; print(heavy)")
    assert done.stdout.strip() == "[]", done.stderr


def test_spark_stays_off_the_core_and_command_import_path() -> None:
    done = run("import sys, idembus.cli.commands, idembus.runtime.endpoint, "
               f"{', '.join(PACKAGES)}; "
               "heavy = [m for m in ('pyspark', 'pandas', 'matplotlib') if m in sys.modules]; "
               "print(heavy)")
    assert done.stdout.strip() == "[]", done.stderr


def test_nothing_is_importable_under_the_folders_names() -> None:
    # The folders are idembus's subpackages, not top-level packages of their own: run from
    # elsewhere, `import storage` finds nothing of idembus's.
    done = run("import importlib.util as u; "
               "print([n for n in ('bus', 'handlers', 'storage', 'transports') "
               "if u.find_spec(n) is not None])", cwd="/")
    assert done.stdout.strip() == "[]", done.stderr


def test_a_users_modules_named_like_the_folders_do_not_shadow_idembus(tmp_path) -> None:
    for name in ("handlers", "storage", "transports", "bus"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user module was imported')")
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        from idembus import Endpoint
        from idembus.storage.memory import MemoryStorage

        def endpoint():
            return Endpoint("shadow-test", storage=MemoryStorage())
    """))
    done = run("import app; print(app.endpoint().name)", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "shadow-test"


@pytest.mark.parametrize("package", [idembus, idembus.handlers, idembus.storage,
                                     idembus.transports])
def test_every_exported_name_exists_and_the_list_is_sorted(package) -> None:
    assert package.__all__ == sorted(package.__all__)
    for name in package.__all__:
        assert getattr(package, name) is not None


def test_idembus_exports_the_whole_public_api() -> None:
    assert set(idembus.__all__) >= {
        "Command", "Event", "Message", "Endpoint", "Handler", "AggregateHandler", "handles",
        "RetryPolicy", "BreakerPolicy", "Backoff", "Batching", "ConflictPolicy", "MemoryStorage",
        "MongoStorage", "PostgresStorage", "KombuTransport", "ConfigurationError"}
    assert idembus.handles is idembus.handlers.handles
    assert idembus.MemoryStorage is idembus.storage.MemoryStorage


def test_an_unknown_attribute_of_idembus_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        idembus.Nope  # noqa: B018


def test_python_dash_m_idembus_is_the_command_line_and_tells_its_version() -> None:
    done = subprocess.run([sys.executable, "-m", "idembus", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: idembus" in done.stdout
    version = subprocess.run([sys.executable, "-m", "idembus", "--version"],
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"idembus {importlib.metadata.version('idembus')}"


@pytest.mark.parametrize(("code", "extra"), [
    ("from idembus import KombuTransport; KombuTransport('redis://127.0.0.1:6379/0')", "redis"),
    ("from idembus import PostgresStorage", "postgres"),
], ids=["redis", "postgres"])
def test_a_missing_optional_dependency_names_the_extra_to_install(code: str, extra: str) -> None:
    # The optional libraries are installed here: hide them from this one interpreter
    hide = ("import sys; sys.modules.update(dict.fromkeys("
            "['redis', 'psycopg', 'psycopg_pool'], None)); ")
    done = run(hide + code)
    assert done.returncode != 0
    assert f"pip install 'idembus[{extra}]'" in done.stderr
