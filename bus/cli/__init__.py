"""The ``idembus`` command (``bus/cli/``): one module per subcommand (:mod:`.commands` holds
``run`` and ``migrate`` and puts the others together), plus the ``--workers`` supervisor and
the loader of ``module:factory`` names.

:func:`main` is the console script's entry point. Importing this package imports nothing
else: ``python -m idembus`` first takes the working directory off ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``idembus`` command line with ``argv`` (default: ``sys.argv[1:]``)."""
    from .commands import main as run

    return run(argv)


__all__ = ["main"]
