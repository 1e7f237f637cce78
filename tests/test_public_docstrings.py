"""Every public name the API reference renders has a docstring (``make lint`` runs this).

The public names are those of ``idembus.__all__`` and of the public subpackages'
``__all__`` (``idembus.handlers``, ``.storage``, ``.transports``, ``.testing``); for their
classes, the public methods and properties the class defines itself. A method overriding
a documented one of a base class (a backend implementing the storage contract) may rely on
the base's docstring.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator

import pytest

PUBLIC_MODULES = ("idembus", "idembus.handlers", "idembus.storage", "idembus.transports",
                  "idembus.testing")


def public_objects() -> Iterator[tuple[str, object]]:
    """(dotted name, object) of every public module, name and public member."""
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        yield module_name, module
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.ismodule(value):
                continue  # idembus.headers: constants, documented by the module itself
            yield f"{module_name}.{name}", value
            if inspect.isclass(value):
                yield from members(f"{module_name}.{name}", value)


def members(prefix: str, cls: type) -> Iterator[tuple[str, object]]:
    """The public methods and properties ``cls`` defines itself (not pydantic's)."""
    for name, value in vars(cls).items():
        if name.startswith("_") or name.startswith("model_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            yield f"{prefix}.{name}", (cls, name, value)


def documented(value: object) -> bool:
    if isinstance(value, tuple):
        cls, name, member = value
        if (member.__doc__ or "").strip():
            return True
        # An override of a documented method of a base class.
        return any((getattr(base, name, None).__doc__ or "").strip()
                   for base in cls.__mro__[1:] if getattr(base, name, None) is not None)
    return bool((getattr(value, "__doc__", None) or "").strip()) and (
        not inspect.isclass(value) or "__doc__" in vars(value))


def test_every_public_name_has_a_docstring():
    missing = [name for name, value in public_objects() if not documented(value)]
    assert missing == [], "public names without a docstring:\n  " + "\n  ".join(missing)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_modules_list_what_they_export(module_name: str):
    module = importlib.import_module(module_name)
    assert module.__all__, module_name
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.{name}"
