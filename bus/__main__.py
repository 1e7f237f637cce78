"""``python -m idembus``: the command line (:mod:`idembus.cli`)."""

import sys

from .cli import main

sys.exit(main())
