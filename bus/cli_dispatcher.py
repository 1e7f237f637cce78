"""``idembus dispatcher package.module:endpoint``: run the endpoint's outbox dispatcher
alone (:mod:`bus.outbox`), without consuming its queue, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from .loading import load_endpoint


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    dispatcher = commands.add_parser(
        "dispatcher", parents=[common],
        help="send committed messages a crash left undispatched (the outbox dispatcher)")
    dispatcher.add_argument("endpoint", help="package.module:endpoint")
    dispatcher.set_defaults(handler=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    endpoint = load_endpoint(args.endpoint)
    try:
        endpoint.storage.verify()
        outbox = endpoint.outbox
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: outbox.request_stop())
        outbox.run()
    finally:
        endpoint.outbox.stop()
        endpoint.close()
    return 0
