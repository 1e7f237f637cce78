"""MongoDB: the outgoing messages of a processed entry too large to keep on its aggregate's
document, kept in a side collection instead (:data:`SPILL`).

A MongoDB document holds at most 16 MiB, and an aggregate document keeps its processed
window, each entry with the messages its handler sent until they are dispatched (and after,
with ``keep_bodies``). So that idembus's own bookkeeping can never reach the limit, an
entry keeps its messages inline only while they are small (:data:`INLINE_BYTES`) and the
document's window still has room for them (:data:`WINDOW_BYTES`); otherwise they go to
side documents of at most :data:`CHUNK_BYTES` each, and the entry keeps a reference
(``spill: <token>``, ``count``).

No transactions: the side documents are written *first*, under ``_id``
``<token>.<n>`` where the token is new for each commit attempt, and the aggregate's
conditional write references them only if it applies. A crash or a refused write in
between leaves side documents no entry references: orphans, which :func:`sweep` (run by
``MongoStorage.expire``, the outbox dispatcher's rounds) deletes once older than a grace
period; so do entries that left the window and tombstones that were deleted. A token is
never reused, so a losing commit can never overwrite the winner's messages.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import bson

from .errors import StorageRefused

#: The side collection of spilled outgoing messages.
SPILL = "idembus_outgoing"
#: An entry's outgoing messages (records and ids) stay on the aggregate's document up to
#: this many bytes; larger fan-outs are spilled.
INLINE_BYTES = 16 * 1024
#: The bytes the processed entries kept on one document may take before a new entry's
#: messages, however small, are spilled.
WINDOW_BYTES = 1024 * 1024
#: The bytes the kept processed entries of one document may take at most: past it the
#: oldest dispatched entries leave the window early (only a window of many thousands of
#: entries gets there, since their messages are spilled past :data:`WINDOW_BYTES`).
KEPT_BYTES = 8 * 1024 * 1024
#: The most one side document holds (one message larger than this gets one of its own).
CHUNK_BYTES = 4 * 1024 * 1024
#: MongoDB's limit on a document.
MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
#: What an entry takes besides its messages (key, flags, time, endpoint, field names).
ENTRY_OVERHEAD = 256
#: How long side documents nobody references are left before :func:`sweep` deletes them:
#: a commit between its side write and its aggregate write must not lose them.
GRACE = datetime.timedelta(hours=1)


def index(database: Any) -> None:
    """The indexes loads (by ``ref``) and :func:`sweep` (first documents, least recently
    checked first, by age) read."""
    side = database[SPILL]
    side.create_index([("ref", 1), ("n", 1)], name="idembus_spill_ref")
    side.create_index([("n", 1), ("checked", 1), ("at", 1)], name="idembus_spill_age")


def bare_bytes(key: str) -> int:
    """What an entry of ``key`` takes without its messages."""
    return len(key.encode("utf-8")) + ENTRY_OVERHEAD


def size_of(records: Sequence[Mapping[str, Any]], ids: Sequence[str]) -> int:
    """The BSON bytes an entry's ``outgoing`` and ``ids`` take."""
    return len(bson.encode({"outgoing": list(records), "ids": list(ids)}))


def chunks(token: str, where: Mapping[str, Any], records: Sequence[Mapping[str, Any]],
           ids: Sequence[str], at: datetime.datetime) -> list[dict[str, Any]]:
    """The side documents of one entry's messages, in order, each under
    :data:`CHUNK_BYTES` unless one message alone is larger; ``where`` names the entry
    (``collection``, ``aggregate_id``, ``key``). A message MongoDB cannot hold at all is
    refused here, with what to do."""
    documents: list[dict[str, Any]] = []
    part: list[Mapping[str, Any]] = []
    part_ids: list[str] = []
    taken = 0
    for record, message_id in zip(records, ids, strict=True):
        size = len(bson.encode({"r": record})) + len(message_id) + 16
        if size > MAX_DOCUMENT_BYTES - 64 * 1024:
            raise StorageRefused(
                f"outgoing message {message_id!r} takes {size} bytes, more than a MongoDB "
                "document can hold; send large payloads by reference (a claim check)")
        if part and taken + size > CHUNK_BYTES:
            documents.append(_chunk(token, len(documents), where, part, part_ids, at))
            part, part_ids, taken = [], [], 0
        part.append(record)
        part_ids.append(message_id)
        taken += size
    documents.append(_chunk(token, len(documents), where, part, part_ids, at))
    return documents


def _chunk(token: str, number: int, where: Mapping[str, Any],
           records: Sequence[Mapping[str, Any]], ids: Sequence[str],
           at: datetime.datetime) -> dict[str, Any]:
    return {"_id": f"{token}.{number}", "ref": token, "n": number, **where,
            "outgoing": list(records), "ids": list(ids), "at": at}


def fetch(collection: Any, wanted: Mapping[str, bool]
          ) -> dict[str, tuple[list[Mapping[str, Any]], list[str]]]:
    """The messages of the spilled entries ``wanted`` (token -> whether their bodies are
    wanted: an entry marked dispatched without ``keep_bodies`` keeps only its ids), in
    order: token -> (records, ids)."""
    found: dict[str, list[Mapping[str, Any]]] = {}
    for bodies, tokens in ((True, [t for t, b in wanted.items() if b]),
                           (False, [t for t, b in wanted.items() if not b])):
        if not tokens:
            continue
        projection = None if bodies else {"outgoing": 0}
        for document in collection.find({"ref": {"$in": tokens}}, projection):
            found.setdefault(document["ref"], []).append(document)
    result: dict[str, tuple[list[Mapping[str, Any]], list[str]]] = {}
    for token, documents in found.items():
        documents.sort(key=lambda document: int(document["n"]))
        result[token] = ([record for d in documents for record in d.get("outgoing", ())],
                         [message_id for d in documents for message_id in d.get("ids", ())])
    return result


def wanted_of(entries: Iterable[Mapping[str, Any]], key: str | None = None
              ) -> dict[str, bool]:
    """The spilled entries among ``entries`` (raw processed entries of documents), only the
    one of ``key`` if given: token -> whether their bodies are still kept."""
    return {entry["spill"]: bool(entry.get("bodies", True)) for entry in entries
            if isinstance(entry.get("spill"), str) and key in (None, entry.get("key"))}


def sweep(database: Any, now: datetime.datetime, *, grace: datetime.timedelta = GRACE,
          batch: int = 1000) -> int:
    """Delete up to ``batch`` entries' side documents older than ``grace`` that no processed
    entry references any more (a commit refused or interrupted after its side write, an
    entry that left its window, a deleted tombstone); returns how many entries' documents
    were deleted. Those still referenced are noted (``checked``) and looked at again after
    the others, so that each round makes progress."""
    side = database[SPILL]
    candidates = list(side.find({"n": 0, "at": {"$lt": now - grace}},
                                {"ref": 1, "collection": 1, "aggregate_id": 1})
                      .sort("checked", 1).limit(batch))
    orphans: list[str] = []
    referenced: list[str] = []
    for document in candidates:
        owner = database[document["collection"]].find_one(
            {"_id": document["aggregate_id"], "processed.spill": document["ref"]}, {"_id": 1})
        (referenced if owner is not None else orphans).append(document["ref"])
    if orphans:
        side.delete_many({"ref": {"$in": orphans}})
    if referenced:
        side.update_many({"ref": {"$in": referenced}, "n": 0}, {"$set": {"checked": now}})
    return len(orphans)
