"""The four packages import on their own, in any order, without side effects."""

from __future__ import annotations

import subprocess
import sys

import pytest

import bus
import handlers
import storage
import transports


@pytest.mark.parametrize("first", ["bus", "handlers", "storage", "transports"])
def test_each_package_imports_first_in_a_fresh_interpreter(first):
    code = f"import {first}; import bus, handlers, storage, transports; print(bus.Endpoint)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "bus.endpoint.Endpoint" in done.stdout


def test_importing_bus_does_not_import_brokers_or_databases():
    code = ("import sys, bus; heavy = [m for m in ('kombu', 'pymongo', 'mongomock', 'psycopg')"
            " if m in sys.modules]; print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_spark_stays_off_the_core_and_command_import_path():
    code = ("import sys, bus, bus.cli, bus.endpoint, handlers, storage, transports; "
            "heavy = [m for m in ('pyspark', 'pandas', 'matplotlib') if m in sys.modules]; "
            "print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("package", [bus, handlers, storage, transports])
def test_every_exported_name_exists_and_the_list_is_sorted(package):
    assert package.__all__ == sorted(package.__all__)
    for name in package.__all__:
        assert getattr(package, name) is not None


def test_an_unknown_attribute_of_bus_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        bus.Nope  # noqa: B018
