"""README's code is executed, so its example cannot drift from the code."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_blocks_that_need_a_cluster_at_least_compile():
    # ```py blocks (Spark) are shown, not run: they need a session and shared services.
    shown = re.findall(r"```py\n(.*?)```", README.read_text(), flags=re.S)
    assert shown
    for block in shown:
        compile(block, str(README), "exec")


def test_readme_has_the_two_commands_first():
    text = README.read_text()
    first_block = re.search(r"```sh\n(.*?)```", text, flags=re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_example_is_about_fifteen_lines():
    example = python_blocks()[0]
    code_lines = [line for line in example.splitlines() if line.strip()]
    assert 12 <= len(code_lines) <= 25


def test_readme_python_blocks_run_in_order(monkeypatch: pytest.MonkeyPatch):
    # The blocks share one module namespace, as if they were one file.
    module = types.ModuleType("readme_example")
    monkeypatch.setitem(sys.modules, "readme_example", module)
    endpoints = []
    try:
        for block in python_blocks():
            exec(compile(block, str(README), "exec"), module.__dict__)
            if "sales" in module.__dict__:
                endpoints.append(module.__dict__["sales"])
        built = module.__dict__["make_endpoint"]()
        assert built.name == "sales" and built.concurrency == 4
        built.transport.close()
        built.storage.close()
    finally:
        for endpoint in endpoints:
            endpoint.close()
