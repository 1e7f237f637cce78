"""``idembus outbox package.module:endpoint``: run the endpoint's outbox relay
alone (:mod:`idembus.runtime.outbox`), without consuming its queue, until SIGINT or SIGTERM.

The dispatcher works in its own thread; the signals only set a flag
(:class:`~idembus.runtime.shutdown.StopSignals`) that the main thread looks at between short waits.
It
then stops the dispatcher (giving its lease up) and closes the endpoint within
``--shutdown-timeout`` seconds. (A handler asking the dispatcher to stop took a lock, and
hung when SIGINT and SIGTERM arrived together.)

Each endpoint's dispatcher sends only the entries that endpoint committed, and its
delayed-message poller only the messages it deferred: what a renamed or retired endpoint
left would wait forever. ``--list-stranded`` prints, per endpoint, how many entries and
delayed messages have waited longer than ``--stranded-after`` seconds (an hour), and
exits. ``--as NAME`` (repeatable) runs, instead of the endpoint's own, the outbox
dispatcher of NAME's entries — and, where the broker cannot hold messages back, the
poller of NAME's delayed messages — with the loaded endpoint's transport, journal and
settings, under NAME's lease (so it never competes with a dispatcher NAME still runs).
Messages they defer again wait for the loaded endpoint's own pollers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
from collections.abc import Sequence
from typing import Any

from ..envelope import utc_now
from ..errors import ConfigurationError
from ..logs import log_uncaught
from ..runtime.background import Periodic
from ..runtime.delayed import DelayedDeliveries
from ..runtime.endpoint import Endpoint
from ..runtime.loading import load_endpoint
from ..runtime.outbox import OutboxRelay
from ..runtime.shutdown import Deadline, StopSignals
from ..storage.base import OVERDUE_DELAYED, OVERDUE_ENTRIES, OutboxStore

log = logging.getLogger(__name__)


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    dispatcher = commands.add_parser(
        "outbox", parents=[common], aliases=["dispatcher"],
        help="send committed messages a crash left undispatched (the outbox relay; "
             "'dispatcher' is its old name, kept for one release)")
    dispatcher.add_argument("endpoint", help="package.module:endpoint")
    dispatcher.add_argument("--shutdown-timeout", type=float, default=30.0,
                            help="seconds to finish the round in progress after "
                                 "SIGINT/SIGTERM (30)")
    task = dispatcher.add_mutually_exclusive_group()
    task.add_argument("--as", dest="as_endpoints", action="append", default=[],
                      metavar="NAME",
                      help="send what the endpoint NAME (renamed or retired) left, instead "
                           "of this endpoint's own, with this endpoint's transport and "
                           "settings; repeat for several")
    task.add_argument("--list-stranded", action="store_true",
                      help="print per endpoint what has waited longer than "
                           "--stranded-after, and exit")
    dispatcher.add_argument("--stranded-after", type=float, default=3600.0,
                            metavar="SECONDS",
                            help="how long waiting counts as stranded (3600)")
    dispatcher.set_defaults(handler=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    log_uncaught()  # its threads' tracebacks, redacted like the log lines
    names = _names(args.as_endpoints)
    if args.stranded_after < 0:
        raise ConfigurationError("--stranded-after must not be negative")
    endpoint = load_endpoint(args.endpoint)
    if args.list_stranded:
        try:
            return _list_stranded(endpoint, args.endpoint,
                                  datetime.timedelta(seconds=args.stranded_after))
        finally:
            endpoint.close()
    workers = _workers_as(endpoint, names) if names else [endpoint.outbox]
    with StopSignals() as signals:
        try:
            endpoint.storage.verify()
            for worker in workers:
                worker.start()
            if names:
                log.info("sending what %s left with the transport of %s, until SIGINT or "
                         "SIGTERM", ", ".join(names), endpoint.name)
            else:
                log.info("outbox relay of %s running alone until SIGINT or SIGTERM",
                         endpoint.name)
            signals.wait()
        finally:
            deadline = Deadline(args.shutdown_timeout)
            try:
                for worker in workers:
                    worker.stop(deadline.left())
            finally:
                endpoint.close(deadline.left())
    return 0


def _names(given: Sequence[str]) -> list[str]:
    """The ``--as`` names, each once, in order; an empty one is a mistake."""
    names = [name.strip() for name in given]
    if any(not name for name in names):
        raise ConfigurationError("--as needs the name of an endpoint")
    return list(dict.fromkeys(names))


def _workers_as(endpoint: Endpoint, names: Sequence[str]) -> list[Periodic]:
    """For each of ``names``: an outbox relay of its entries and, unless the broker
    holds deferred messages itself, a poller of its delayed messages; both send with
    ``endpoint``'s transport and journal, and messages they defer again are ``endpoint``'s
    own to send later."""
    own = endpoint.outbox
    workers: list[Periodic] = []
    for name in names:
        # NAME's entries and leases, sent with the endpoint's own dispatcher: what they
        # defer again is the endpoint's to send later.
        context = dataclasses.replace(endpoint.context, name=name)
        workers.append(OutboxRelay(
            context, endpoint.dispatcher, lease_ttl=own.lease_ttl, grace=own.grace,
            # Journal trimming is the storage's, done by the endpoint's own relay.
            max_attempts=own.max_attempts, journal_retention=None))
        if not endpoint.transport.native_delay:
            workers.append(DelayedDeliveries(context))
    return workers


#: How :func:`_list_stranded` names each kind: one, several, and what its time means.
_KINDS = {OVERDUE_ENTRIES: ("entry", "entries", "waiting"),
          OVERDUE_DELAYED: ("delayed message", "delayed messages", "due")}


def _list_stranded(endpoint: Endpoint, reference: str, after: datetime.timedelta) -> int:
    """Print what has waited longer than ``after``, a line per endpoint and kind."""
    endpoint.storage.verify()
    overdue = endpoint.storage_as(OutboxStore).overdue(utc_now() - after)
    if not overdue:
        print(f"nothing has waited longer than {after}")
        return 0
    for item in overdue:
        one, several, verb = _KINDS[item.kind]
        who = item.endpoint if item.endpoint is not None else "(no originating endpoint)"
        print(f"{who}: {item.count} {one if item.count == 1 else several} {verb} since "
              f"{item.since.isoformat(timespec='seconds')}")
    if any(item.endpoint is not None for item in overdue):
        print(f"an endpoint that no longer runs under its name: idembus outbox "
              f"{reference} --as NAME sends what it left")
    return 0
