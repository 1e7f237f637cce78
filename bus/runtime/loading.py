"""Finding an endpoint from a command line: ``package.module:endpoint``.

The user's modules are looked for in the working directory *after* the installed packages
(``--app-dir`` puts a directory first on purpose), so that a file of the user's named like
a library (``psycopg.py``, ``kombu.py``) never stands in for it: :func:`load_endpoint`
appends the working directory to ``sys.path``, and :func:`working_directory_last` takes it
off the front, where ``python -m idembus`` finds it.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ..errors import ConfigurationError


def load_endpoint(reference: str) -> Any:
    """Import ``package.module:attribute`` and return the endpoint it names."""
    from .endpoint import Endpoint

    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(
            f"{reference!r} is not of the form package.module:endpoint"
        )
    module = import_user_module(module_name)
    try:
        target = getattr(module, attribute)
    except AttributeError:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if isinstance(target, type):  # calling a class would build who knows what
        raise ConfigurationError(
            f"{reference} is the class {target.__qualname__}, not an Endpoint (or a function "
            "returning one)")
    if callable(target) and not isinstance(target, Endpoint):
        target = target()
    if not isinstance(target, Endpoint):
        raise ConfigurationError(
            f"{reference} is a {type(target).__name__}, not an Endpoint (or a function "
            "returning one)"
        )
    return target


def import_user_module(module_name: str, what: str = "") -> Any:
    """Import the user's module ``module_name``, looked for in the working directory after
    the installed packages; a :class:`~idembus.errors.ConfigurationError` (starting with
    ``what``) if it cannot be imported."""
    if os.getcwd() not in sys.path:  # after the installed packages: never shadowing them
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"{what}cannot import {module_name!r}: {exc}"
                                 f"{_where_to_look(module_name, exc)}") from exc


def _where_to_look(module_name: str, error: ImportError) -> str:
    """What to add to "cannot import" when the module itself (or its package) was not
    found, rather than something it imports: where it was looked for, and ``--app-dir``."""
    missing = getattr(error, "name", None)
    if not isinstance(error, ModuleNotFoundError) or not missing or not (
            module_name == missing or module_name.startswith(f"{missing}.")):
        return ""
    return (f" (looked for it in the installed packages and in the working directory "
            f"{os.getcwd()}): run the command from the folder that holds it, or pass "
            "--app-dir FOLDER")


def working_directory_last(path: list[str]) -> None:
    """Take the working directory off the front of ``path`` (``sys.path``), where Python
    puts it for ``python -m`` and ``python -c`` (as ``''``), so that the user's modules
    come after the installed packages (:func:`load_endpoint` adds it back at the end).
    Nothing changes under ``-P`` / ``PYTHONSAFEPATH``, where Python put nothing there."""
    if getattr(sys.flags, "safe_path", False) or not path:
        return
    if path[0] in ("", os.getcwd()):
        del path[0]


def refuse_process_local(part: Any, *, endpoint: str, role: str, unseen: str) -> None:
    """Refuse a command run in a process of its own on an endpoint whose ``role``
    (``"storage"`` or ``"transport"``) ``part`` lives inside one process (``process_local``:
    memory://, :class:`~idembus.storage.memory.MemoryStorage`, an embedded mongomock): the
    command would find none of the endpoint's ``unseen`` and say so as if there were none.
    A :class:`~idembus.errors.ConfigurationError` (exit status 2) naming the reason."""
    if not getattr(part, "process_local", False):
        return
    shared = ("a database (PostgreSQL, MongoDB)" if role == "storage"
              else "a broker (RabbitMQ, Redis) or a database (PostgreSQL, MongoDB)")
    raise ConfigurationError(
        f"the {role} of endpoint {endpoint!r} ({type(part).__name__}) is process-local: "
        f"another process cannot see its {unseen}. Give the endpoint {shared} that its "
        "processes share."
    )


def built_by_loading(reference: str, endpoint: Any) -> bool:
    """True if :func:`load_endpoint` built ``endpoint`` by calling a factory (the caller
    owns it and closes it); False if it is the module's own Endpoint object, shared by
    whoever imports the module."""
    module_name, _, attribute = reference.partition(":")
    return getattr(sys.modules.get(module_name), attribute, None) is not endpoint
