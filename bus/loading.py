"""Finding an endpoint from a command line: ``package.module:endpoint``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from .errors import ConfigurationError


def load_endpoint(reference: str) -> Any:
    """Import ``package.module:attribute`` and return the endpoint it names."""
    from .endpoint import Endpoint

    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(
            f"{reference!r} is not of the form package.module:endpoint"
        )
    if os.getcwd() not in sys.path:  # after the installed packages: never shadowing them
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
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


def built_by_loading(reference: str, endpoint: Any) -> bool:
    """True if :func:`load_endpoint` built ``endpoint`` by calling a factory (the caller
    owns it and closes it); False if it is the module's own Endpoint object, shared by
    whoever imports the module."""
    module_name, _, attribute = reference.partition(":")
    return getattr(sys.modules.get(module_name), attribute, None) is not endpoint
