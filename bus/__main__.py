"""``python -m idembus``: the command line (:mod:`idembus.cli.commands`).

Python puts the working directory first on ``sys.path`` for ``-m``; it is taken off before
the command line and the libraries it uses are imported, so that a file of the user's named
like one of them (``psycopg.py``, ``kombu.py``, ``json.py``) is never imported instead. The
endpoint's module is still found in the working directory: the loader looks there after the
installed packages (and ``--app-dir`` looks first). Only what ``import idembus`` imports
before this module runs (pydantic) could still be shadowed; the installed ``idembus``
command, whose script directory comes first instead, has no such gap.
"""

import sys

from .runtime.loading import working_directory_last


def _main() -> int:
    working_directory_last(sys.path)
    from .cli import main

    return main()


sys.exit(_main())
