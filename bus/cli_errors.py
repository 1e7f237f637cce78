"""``idembus errors``: look at, retry and purge the messages in an endpoint's error queue.

    idembus errors list  package.module:endpoint [--type T] [--exception E] [--json]
    idembus errors show  package.module:endpoint ID [--json]
    idembus errors export package.module:endpoint FILE [--type T] [--exception E]
    idembus errors retry package.module:endpoint (ID... | --all | --type T | --exception E)
    idembus errors purge package.module:endpoint (ID... | --all | --type T | --exception E)

The endpoint is loaded (not started) for its transport, ``error_queue`` and storage, and
closed at the end. One whose broker or storage lives inside one process (memory://,
MemoryStorage, an embedded mongomock) is refused with exit status 2: another process
cannot see its error queue or its parked messages. Messages the broker refused even a place
in the error queue are parked in the storage (:mod:`idembus.parking`): they are listed,
shown, retried and purged with the error queue's (``KEPT IN``: ``parked``); a retried one
goes to its own destination.

``list``, ``show`` and ``export`` only read: they go through the error queue a page
(:data:`PAGE` messages) at a time with ``KombuTransport.browse``, printing as they go, so
that a long error queue never has to fit in memory; nothing is lost, and no message is
read twice (on RabbitMQ the messages read stay unacknowledged, out of everyone else's
reach, until the end; on Redis and memory:// each page goes back behind the rest once
read). ``retry`` and ``purge`` take the whole queue unsettled with ``Transport.inspect``
and every message not retried or purged goes back (its place in the queue may change).

``retry`` sends each selected message back to the queue that failed it
(``idembus.failed_queue``) with the failure headers removed, so its attempt counters start
again; its message id and everything else are unchanged, so handlers that had already
processed it find it processed. Only then is it removed from the error queue: a crash in
between leaves a copy in both queues, never none. ``--type`` matches the message type
exactly; ``--exception`` the exception type by its full or last dotted name
(``ValueError`` matches ``builtins.ValueError``); both together select what matches both.
An ID selects every copy of that message in the error queue.

Exit status: 0 on success; 2 when an ID is not in the error queue, the arguments are
wrong, or a selected message cannot be retried (it has no failed queue).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from . import headers as h
from .envelope import Envelope, parse_utc
from .errors import ConfigurationError
from .loading import load_endpoint, refuse_process_local
from .parking import ParkedDelivery, parked_deliveries
from .recoverability import without_failure_headers
from .redaction import redact
from .storage.errors import StorageError
from .supervisor import EXIT_CONFIGURATION
from .transports.base import Delivery
from .transports.errors import TransportUnavailable

if TYPE_CHECKING:
    from .endpoint import Endpoint

#: Longest exception message shown by ``errors list`` (``--json`` gives it whole).
_SHORT_MESSAGE = 60
#: How many messages of the error queue ``list``, ``show`` and ``export`` hold at a time
#: (and ``list`` prints at a time).
PAGE = 100
_MISSING = "-"


# -- reading failed messages -------------------------------------------------------------


@dataclass(frozen=True)
class FailedMessage:
    """One message of the error queue, as its failure headers tell it."""

    message_id: str | None
    message_type: str | None
    exception_type: str | None
    exception_message: str | None
    failed_queue: str | None
    time_of_failure: str | None
    immediate_attempts: str | None
    delayed_attempts: str | None
    #: Kept in the storage because the broker refused it a place (``idembus.parking``).
    parked: bool = False

    @classmethod
    def of(cls, delivery: Delivery) -> FailedMessage:
        """Read the failure story from a delivery's headers."""
        headers = delivery.headers
        return cls(
            parked=isinstance(delivery, ParkedDelivery),
            message_id=headers.get(h.MESSAGE_ID),
            message_type=headers.get(h.MESSAGE_TYPE),
            exception_type=headers.get(h.EXCEPTION_TYPE),
            exception_message=headers.get(h.EXCEPTION_MESSAGE),
            failed_queue=headers.get(h.FAILED_QUEUE),
            time_of_failure=headers.get(h.TIME_OF_FAILURE),
            immediate_attempts=headers.get(h.IMMEDIATE_ATTEMPTS),
            delayed_attempts=headers.get(h.DELAYED_ATTEMPTS),
        )

    def columns(self) -> list[str]:
        """The cells of this message's row in ``errors list``."""
        return [
            self.message_id or _MISSING,
            self.message_type or _MISSING,
            self.exception_type or _MISSING,
            _shorten(self.exception_message or _MISSING, _SHORT_MESSAGE),
            self.failed_queue or _MISSING,
            _readable_time(self.time_of_failure),
            f"{self.immediate_attempts or 0}/{self.delayed_attempts or 0}",
            "parked" if self.parked else "error queue",
        ]


_COLUMN_TITLES = ["MESSAGE ID", "TYPE", "EXCEPTION", "MESSAGE", "FAILED QUEUE",
                  "TIME OF FAILURE (UTC)", "ATTEMPTS (IMM/DEL)", "KEPT IN"]


def _shorten(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def _readable_time(text: str | None) -> str:
    """A time header as ``YYYY-MM-DD HH:MM:SS`` UTC (unchanged if unreadable)."""
    moment = parse_utc(text)
    return moment.strftime("%Y-%m-%d %H:%M:%S") if moment else (text or _MISSING)


def exception_matches(exception_type: str | None, wanted: str) -> bool:
    """True if ``wanted`` is the full dotted name of the exception type or its last part."""
    if not exception_type:
        return False
    return wanted in (exception_type, exception_type.rsplit(".", 1)[-1])


# -- choosing messages -------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """Which messages of the error queue a command acts on."""

    ids: tuple[str, ...] = ()
    everything: bool = False
    message_type: str | None = None
    exception: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Selection:
        return cls(ids=tuple(getattr(args, "ids", ()) or ()),
                   everything=bool(getattr(args, "all", False)),
                   message_type=args.type, exception=args.exception)

    @property
    def by_filter(self) -> bool:
        return self.message_type is not None or self.exception is not None

    def require(self, command: str) -> None:
        """Refuse an empty or ambiguous selection (ConfigurationError: exit status 2)."""
        kinds = [bool(self.ids), self.everything, self.by_filter]
        if sum(kinds) == 0:
            raise ConfigurationError(
                f"errors {command} needs a selection: message ids, --all, --type or "
                "--exception")
        if sum(kinds) > 1:
            raise ConfigurationError(
                f"errors {command}: give message ids, --all, or --type/--exception, "
                "not several of them")

    def matches(self, delivery: Delivery) -> bool:
        headers = delivery.headers
        if self.ids:
            return headers.get(h.MESSAGE_ID) in self.ids
        if self.message_type is not None and headers.get(h.MESSAGE_TYPE) != self.message_type:
            return False
        if self.exception is not None:
            return exception_matches(headers.get(h.EXCEPTION_TYPE), self.exception)
        return True

    def pick(self, deliveries: Sequence[Delivery], queue: str) -> list[Delivery]:
        """The selected deliveries; ConfigurationError if a given id is not among them."""
        chosen = [delivery for delivery in deliveries if self.matches(delivery)]
        found = {delivery.headers.get(h.MESSAGE_ID) for delivery in chosen}
        missing = [message_id for message_id in self.ids if message_id not in found]
        if missing:
            raise ConfigurationError(
                f"no message {', '.join(missing)} in the error queue {queue!r}; nothing "
                "was changed (see: idembus errors list)")
        return chosen


# -- the retried message -----------------------------------------------------------------


def retried_envelope(delivery: Delivery) -> Envelope:
    """The message as it was before it failed, addressed to the queue that failed it."""
    queue = delivery.headers.get(h.FAILED_QUEUE)
    if not queue:
        raise ConfigurationError(
            f"message {delivery.headers.get(h.MESSAGE_ID, '(without id)')} has no "
            f"{h.FAILED_QUEUE} header: there is no queue to return it to")
    headers = without_failure_headers(delivery.headers)
    return Envelope(
        headers=headers,
        body=delivery.body.decode("utf-8", "surrogateescape"),
        destination=queue,
        content_type=delivery.content_type or h.CONTENT_TYPE,
        content_encoding=delivery.content_encoding,
    )


# -- commands ----------------------------------------------------------------------------


@contextmanager
def _endpoint(args: argparse.Namespace) -> Iterator[Endpoint]:
    """The endpoint (not started), closed after. One whose broker or storage lives inside
    one process is refused (its error queue and parked messages are out of this process's
    sight), and a broker or database that cannot be read is a ConfigurationError (exit
    status 2, one line): never "0 messages"."""
    endpoint = load_endpoint(args.endpoint)
    try:
        refuse_process_local(endpoint.transport, endpoint=endpoint.name, role="transport",
                             unseen="error queue")
        refuse_process_local(endpoint.storage, endpoint=endpoint.name, role="storage",
                             unseen="parked messages")
        yield endpoint
    except (TransportUnavailable, StorageError) as unreadable:
        raise ConfigurationError(f"cannot read the failed messages of {endpoint.name}: "
                                 f"{redact(str(unreadable))}") from unreadable
    finally:
        endpoint.close()


def _own(args: argparse.Namespace, endpoint: Endpoint,
         deliveries: Iterable[Delivery]) -> Iterator[Delivery]:
    """The deliveries of the error queue that failed in the endpoint's own queue (every one
    with ``--all-endpoints``: error queues are often shared), then the messages it parked
    in its storage."""
    for delivery in deliveries:
        if args.all_endpoints or delivery.headers.get(h.FAILED_QUEUE) == endpoint.name:
            yield delivery
    yield from parked_deliveries(endpoint.storage, endpoint.name)


@contextmanager
def _error_queue(args: argparse.Namespace) -> Iterator[tuple[Endpoint, list[Delivery]]]:
    """The endpoint and its failed messages (:func:`_own`), all taken unsettled for the
    block (``Transport.inspect``): for commands that retry or purge some of them."""
    with _endpoint(args) as endpoint, \
            endpoint.transport.inspect(endpoint.error_queue) as deliveries:
        yield endpoint, list(_own(args, endpoint, deliveries))


@runtime_checkable
class _Browsing(Protocol):
    """A transport that reads a queue a page at a time (``KombuTransport.browse``)."""

    def browse(self, queue: str, *,
               page: int = ...) -> AbstractContextManager[Iterator[Delivery]]: ...


@contextmanager
def _failed_messages(args: argparse.Namespace) -> Iterator[tuple[Endpoint, Iterator[Delivery]]]:
    """The endpoint and its failed messages (:func:`_own`) one after the other, for
    commands that only read them: at most :data:`PAGE` of the error queue are held at a
    time where the transport can browse, whatever the length of the queue."""
    with _endpoint(args) as endpoint:
        transport = endpoint.transport
        reading = (transport.browse(endpoint.error_queue, page=PAGE)
                   if isinstance(transport, _Browsing)
                   else transport.inspect(endpoint.error_queue))
        with reading as deliveries:
            yield endpoint, _own(args, endpoint, deliveries)


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` safe for a terminal: control characters (an escape sequence a hostile
    message carries) shown as ``\\xNN``; with ``lines``, newlines and tabs kept."""
    kept = "\n\t" if lines else ""
    return "".join(character if character.isprintable() or character in kept
                   else f"\\x{ord(character):02x}" if ord(character) < 256
                   else f"\\u{ord(character):04x}" for character in text)


def _list(args: argparse.Namespace) -> int:
    selection = Selection(message_type=args.type, exception=args.exception)
    with _failed_messages(args) as (endpoint, deliveries):
        failed = (FailedMessage.of(d) for d in deliveries if selection.matches(d))
        count = _print_json(failed) if args.json else _print_rows(failed)
    if not args.json:
        print(f"{count} failed message(s) in {endpoint.error_queue!r}")
    return 0


def _print_json(messages: Iterable[FailedMessage]) -> int:
    """Print ``messages`` as one JSON array (as ``json.dumps(..., indent=2)`` would), each
    as soon as it is read; how many there were."""
    count = 0
    for message in messages:
        text = textwrap.indent(json.dumps(asdict(message), indent=2), "  ")
        print(("[\n" if count == 0 else ",\n") + text, end="")
        count += 1
    print("\n]" if count else "[]")
    return count


def _print_rows(messages: Iterable[FailedMessage]) -> int:
    """Print ``messages`` as a table, :data:`PAGE` rows at a time (each column as wide as
    its widest cell so far); how many there were."""
    widths = [len(title) for title in _COLUMN_TITLES]
    rows: list[list[str]] = []
    count = 0
    for message in messages:
        if count == 0:
            rows.append(_COLUMN_TITLES)
        rows.append(message.columns())
        count += 1
        if len(rows) >= PAGE:
            widths = _print_table(rows, widths)
            rows = []
    if rows:
        _print_table(rows, widths)
    return count


def _print_table(rows: list[list[str]], widths: list[int]) -> list[int]:
    """Print ``rows``, each column at least as wide as ``widths`` says; the widths used."""
    widths = [max(widths[column], *(len(row[column]) for row in rows))
              for column in range(len(widths))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(printable("  ".join(cells).rstrip()))
    return widths


def _show(args: argparse.Namespace) -> int:
    selection = Selection(ids=(args.id,))
    with _failed_messages(args) as (endpoint, deliveries):
        chosen = selection.pick([d for d in deliveries if selection.matches(d)],
                                endpoint.error_queue)
        shown = [_described(delivery) for delivery in chosen]
    if args.json:
        print(json.dumps(shown, indent=2, ensure_ascii=False))
        return 0
    for index, message in enumerate(shown):
        if index:
            print()
        _print_message(message, endpoint.error_queue)
    return 0


def _described(delivery: Delivery) -> dict[str, Any]:
    return {"headers": dict(sorted(delivery.headers.items())),
            "content_type": delivery.content_type,
            "body": delivery.body.decode("utf-8", "replace")}


def _print_message(message: dict[str, Any], queue: str) -> None:
    message_id = message['headers'].get(h.MESSAGE_ID, '(without id)')
    print(printable(f"message {message_id} in {queue!r}"))
    print("headers:")
    for name, value in message["headers"].items():
        lines = str(value).splitlines() or [""]
        print(printable(f"  {name}: {lines[0]}"))
        for line in lines[1:]:
            print(printable(f"      {line}"))
    print(printable(f"body ({message['content_type'] or 'no content type'}):"))
    print(printable(message["body"], lines=True))


def _export(args: argparse.Namespace) -> int:
    """Write the selected failed messages as JSON lines that ``idembus spark replay`` reads
    (message_id, message_type, body, headers without the failure story, and when and where
    it failed). They stay in the error queue: purge them once replayed."""
    selection = Selection(message_type=args.type, exception=args.exception)
    written = 0
    with _failed_messages(args) as (endpoint, deliveries):
        with open(args.file, "w", encoding="utf-8") as out:
            for delivery in (d for d in deliveries if selection.matches(d)):
                written += 1
                out.write(json.dumps({
                    "message_id": delivery.headers.get(h.MESSAGE_ID),
                    "message_type": delivery.headers.get(h.MESSAGE_TYPE),
                    "body": delivery.body.decode("utf-8", "replace"),
                    "headers": json.dumps(without_failure_headers(delivery.headers)),
                    "failed_queue": delivery.headers.get(h.FAILED_QUEUE),
                    "time_of_failure": delivery.headers.get(h.TIME_OF_FAILURE),
                }, ensure_ascii=False) + "\n")
    print(f"{written} message(s) of {endpoint.error_queue!r} written to {args.file}")
    return 0


def _retry(args: argparse.Namespace) -> int:
    selection = Selection.from_args(args)
    selection.require("retry")
    status = 0
    with _error_queue(args) as (endpoint, deliveries):
        retried = 0
        for delivery in selection.pick(deliveries, endpoint.error_queue):
            if isinstance(delivery, ParkedDelivery):
                envelope = delivery.retried()
                endpoint.transport.dispatch(envelope)  # an event is published again
                delivery.ack()
                retried += 1
                print(f"retried {envelope.headers.get(h.MESSAGE_ID, '(without id)')} "
                      f"from the storage to {envelope.destination or 'its subscribers'!r}")
                continue
            try:
                envelope = retried_envelope(delivery)
            except ConfigurationError as exc:
                print(f"idembus: {redact(str(exc))}; left in {endpoint.error_queue!r}",
                      file=sys.stderr)
                status = EXIT_CONFIGURATION
                continue
            endpoint.transport.send(envelope)
            delivery.ack()  # only once the broker has the retried copy
            retried += 1
            print(f"retried {envelope.headers.get(h.MESSAGE_ID, '(without id)')} "
                  f"to {envelope.destination!r}")
    print(f"{retried} message(s) retried from {endpoint.error_queue!r}")
    return status


def _purge(args: argparse.Namespace) -> int:
    selection = Selection.from_args(args)
    selection.require("purge")
    with _error_queue(args) as (endpoint, deliveries):
        chosen = selection.pick(deliveries, endpoint.error_queue)
        if args.dry_run:
            for delivery in chosen:
                print(printable(f"would purge {delivery.headers.get(h.MESSAGE_ID, '-')}"))
            print(f"{len(chosen)} message(s) would be purged from {endpoint.error_queue!r}")
            return 0
        if chosen and not args.yes and not _confirmed(
                f"purge {len(chosen)} message(s) from {endpoint.error_queue!r} for good?"):
            print("nothing purged")
            return EXIT_CONFIGURATION
        for delivery in chosen:
            delivery.ack()
    print(f"{len(chosen)} message(s) purged from {endpoint.error_queue!r}")
    return 0


def _confirmed(question: str) -> bool:
    """Ask at a terminal; elsewhere (a script) refuse: ``--yes`` says it."""
    if not sys.stdin.isatty():
        raise ConfigurationError(f"{question} Not at a terminal: pass --yes to purge, or "
                                 "--dry-run to see what would go")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


# -- the command line --------------------------------------------------------------------


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``idembus errors {list,show,retry,purge}`` to the ``idembus`` command."""
    errors = commands.add_parser(
        "errors", help="list, show, retry or purge the messages in an endpoint's error queue",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = errors.add_subparsers(dest="errors_command", required=True)

    listing = _action(actions, common, "list", "one line per failed message", _list)
    _add_filters(listing)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")

    show = _action(actions, common, "show", "every header and the body of a message", _show)
    show.add_argument("id", help="message id (idembus.message_id)")
    show.add_argument("--json", action="store_true", help="print JSON")

    export = _action(actions, common, "export",
                     "write failed messages as JSON lines for idembus spark replay", _export)
    export.add_argument("file", help="the JSON lines file to write")
    _add_filters(export)

    for name, summary, handler in (
        ("retry", "send messages back to the queue that failed them, counters reset", _retry),
        ("purge", "delete messages from the error queue for good", _purge),
    ):
        parser = _action(actions, common, name, summary, handler)
        parser.add_argument("ids", nargs="*", metavar="ID", help="message ids")
        parser.add_argument("--all", action="store_true", help="every message")
        _add_filters(parser)
        if name == "purge":
            parser.add_argument("--yes", action="store_true", help="do not ask")
            parser.add_argument("--dry-run", action="store_true",
                                help="list what would be purged, purge nothing")


def _action(actions: Any, common: argparse.ArgumentParser, name: str, summary: str,
            handler: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(
        name, parents=[common], help=summary, description=summary)
    parser.add_argument("endpoint", help="package.module:endpoint")
    parser.add_argument("--all-endpoints", action="store_true",
                        help="every message in the error queue, not only those that failed "
                             "in this endpoint's queue")
    parser.set_defaults(handler=handler)
    return parser


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--type", help="only messages of this message type (exact name)")
    parser.add_argument("--exception", help="only messages that failed with this exception "
                        "type (full or last dotted name: ValueError)")
