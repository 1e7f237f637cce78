"""``python -m samples.torture``: run the torture test, print its line, exit 0 if it holds.

The line goes to stdout; progress, notes and what is off go to stderr. Exit status: 0 if
every order took effect exactly once and everything recovered, 1 if not, 2 if the run
could not start.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

from samples.torture.options import parse
from samples.torture.run import CannotRun, torture


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s torture %(levelname)s %(message)s")
    # SIGTERM unwinds like Ctrl-C, so that the broker is started again and the workers,
    # queues and tables are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        outcome = torture(options)
    except CannotRun as error:
        print(f"torture: {error}", file=sys.stderr)
        return 2
    for note in outcome.notes:
        print(f"torture: {note}", file=sys.stderr)
    for problem in outcome.problems:
        print(f"torture: FAILED: {problem}", file=sys.stderr)
    print(outcome.report.line(), flush=True)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
