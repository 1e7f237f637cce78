"""Waking the outbox dispatcher from a MongoDB change stream (replica sets and sharded
clusters only).

**Never run against a server**: no replica set is available where this project is built
and tested, so the stream itself has not been verified at all. This path is written against
pymongo's documented API (``Database.watch``, ``ChangeStream.try_next``, ``resume_token``,
``start_at_operation_time``) and guarded, so that on mongomock or a standalone server the
dispatcher polls instead. Only the filter (:func:`commit_pipeline`) is tested, by mongomock's
aggregation over change events shaped as the server documents them; nothing else here is
exercised by mongomock, and nothing fakes what mongomock lacks. If the stream fails, the
dispatcher logs it and polls.

How it works: the watcher follows the commits in the endpoint's database
(:func:`commit_pipeline`: aggregate and inbox writes, not idembus's own collections and not
dispatch marks) and wakes the dispatcher on each batch of changes. After each batch it saves the
stream's resume token in the dispatcher's lease document, in a write fenced by the lease's
token (a watcher whose lease was taken cannot move the checkpoint). On start it resumes
after the saved token; with none it starts at the oldest entry of the oplog, so that
commits made while no dispatcher watched are seen.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pymongo
import pymongo.errors

from .base import INBOX, Lease
from .errors import StaleLease

log = logging.getLogger(__name__)

#: How long one wait for changes lasts before ``stop`` is looked at again (ms).
_AWAIT_MS = 1000


def can_watch(client: Any) -> bool:
    """True for a replica set member or a mongos: where change streams exist."""
    try:
        hello = client.admin.command("hello")
    except Exception:  # unreachable, too old, or mongomock (NotImplementedError): poll
        return False
    return "setName" in hello or hello.get("msg") == "isdbgrid"


def follow(database: Any, leases: Any, lease_name: str, wake: Callable[[], None],
           stop: threading.Event, lease: Callable[[], Lease | None]) -> None:
    """Wake the dispatcher on changes until ``stop``; see the module docstring."""
    saved = leases.find_one({"_id": lease_name}, {"resume_token": 1}) or {}
    options: dict[str, Any] = {"max_await_time_ms": _AWAIT_MS}
    if saved.get("resume_token"):
        options["resume_after"] = saved["resume_token"]
    else:
        oldest = _oldest_oplog_time(database.client)
        if oldest is not None:
            options["start_at_operation_time"] = oldest
    with database.watch(commit_pipeline(), **options) as stream:
        while not stop.is_set() and stream.alive:
            change = stream.try_next()
            if change is None:
                continue
            while change is not None:  # drain the batch, then wake once
                change = stream.try_next() if stream.alive else None
            wake()
            _save(leases, lease_name, lease(), stream.resume_token)


def commit_pipeline() -> list[dict[str, Any]]:
    """The change-stream filter: only what a commit writes. Inserts and replacements of
    documents in aggregate collections and the inbox, and updates that change an
    aggregate's ``version`` or add an inbox entry — not idembus's own collections (leases,
    status, audit, journal, delayed and parked messages, the note of aggregate
    collections), whose writes would otherwise wake the dispatcher on every status
    report, and not dispatch marks."""
    return [{"$match": {"$and": [
        {"operationType": {"$in": ["insert", "update", "replace"]}},
        {"$or": [{"ns.coll": INBOX}, {"ns.coll": {"$not": {"$regex": "^idembus_"}}}]},
        {"$or": [{"operationType": {"$in": ["insert", "replace"]}},
                 {"updateDescription.updatedFields.version": {"$exists": True}}]},
    ]}}]


def _save(leases: Any, lease_name: str, held: Lease | None, token: Any) -> None:
    if held is None:
        return  # not the dispatcher at work: it does not own the checkpoint
    result = leases.update_one({"_id": lease_name, "token": held.token},
                               {"$set": {"resume_token": token}})
    if result.matched_count == 0:
        raise StaleLease(f"lease {lease_name!r} token {held.token} was superseded")


def _oldest_oplog_time(client: Any) -> Any:
    """The timestamp of the oldest oplog entry (a replica set's ``local.oplog.rs``)."""
    try:
        entry = client.local["oplog.rs"].find_one(sort=[("$natural", pymongo.ASCENDING)])
    except pymongo.errors.PyMongoError:
        log.warning("cannot read the oplog; the change stream starts now")
        return None
    return entry["ts"] if entry else None
