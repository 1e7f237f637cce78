"""The ``idembus`` command.

    idembus run package.module:endpoint [--concurrency N]
    idembus migrate package.module:endpoint

``endpoint`` names an :class:`~bus.endpoint.Endpoint`, or a function returning one, in an
importable module; it runs until SIGINT or SIGTERM and then stops gracefully.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from bus.errors import BusError, ConfigurationError


def load_endpoint(reference: str) -> Any:
    """Import ``package.module:attribute`` and return the endpoint it names."""
    from bus.endpoint import Endpoint

    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(
            f"{reference!r} is not of the form package.module:endpoint"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    try:
        target = getattr(module, attribute)
    except AttributeError:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if callable(target) and not isinstance(target, Endpoint):
        target = target()
    if not isinstance(target, Endpoint):
        raise ConfigurationError(
            f"{reference} is a {type(target).__name__}, not an Endpoint (or a function "
            "returning one)"
        )
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="idembus", description="Run idembus endpoints.")
    parser.add_argument("--log-level", default="INFO", help="logging level (INFO)")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one endpoint until SIGINT/SIGTERM")
    run.add_argument("endpoint", help="package.module:endpoint")
    run.add_argument("--concurrency", type=int, help="consumer threads (the endpoint's own)")
    migrate = commands.add_parser(
        "migrate", help="create the endpoint's storage schema (tables, indexes) and exit")
    migrate.add_argument("endpoint", help="package.module:endpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        endpoint = load_endpoint(args.endpoint)
        if args.command == "migrate":
            endpoint.storage.migrate()
            print(f"{endpoint.name}: {type(endpoint.storage).__name__} schema is in place")
            endpoint.close()
            return 0
        if args.concurrency is not None:
            if args.concurrency < 1:
                raise ConfigurationError("--concurrency must be at least 1")
            endpoint.concurrency = args.concurrency
        endpoint.run()
    except BusError as exc:
        print(f"idembus: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
