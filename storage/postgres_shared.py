"""The commit of :meth:`PostgresStorage.commit_with` as one statement with another's part
(the PostgreSQL transport's inserts of the outgoing messages and deletion of the incoming
one: :mod:`idembus.runtime.shared_transaction`).

One statement, in one round trip, atomic on its own::

    WITH <part's inputs>,
         changed AS (<the aggregate's conditional update or insert>, only if the part's
                     precondition holds),
         recorded AS (<the processed row, recorded dispatched>),
         <part's effects, each only if recorded has a row>
    SELECT <rows recorded>, <precondition>, <part's result>

and then, after a pipeline sync, the part's ``after`` statement (which does not run if the
first one failed): in a pipeline the statements up to a sync are one implicit transaction,
and ``after`` commits without waiting for the disk, which must not apply to the commit.

The write is the one :meth:`PostgresStorage.commit` makes (the same conditions, so a lost
race or a duplicate is refused the same way: nothing written, or a unique violation); the
part's precondition (every sent message has a declared queue) guards it, so that either
everything happens or nothing does. Parameters are named: the part's start with ``bus_``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

#: What the part's effects are conditioned on: the commit's write happened.
RECORDED = "EXISTS (SELECT 1 FROM recorded)"


class StatementPart(Protocol):
    """Another's part of the shared statement (SQL with named parameters)."""

    #: Common table expressions the write's precondition may read.
    inputs: str
    #: A boolean SQL expression: the write happens only if it is true.
    precondition: str
    #: A SQL expression read back with the result.
    result: str
    #: A statement run right after the commit, in a transaction of its own (the
    #: transport's: waking the consumers of the queues written to).
    after: str
    params: Mapping[str, Any]

    def effects(self, guard: str) -> str:
        """Common table expressions that change data only where ``guard`` holds."""
        ...


def statement(aggregates: str, processed: str, *, kind: str, part: StatementPart) -> str:
    """The shared commit of an aggregate (``kind``: ``inbox``, ``create`` or ``update``)."""
    record = (f"INSERT INTO {processed} (aggregate_type, aggregate_id, key, outgoing, "
              "outgoing_ids, dispatched, message_type) SELECT %(type)s, %(id)s, %(key)s, "
              "%(outgoing)s, %(ids)s, true, %(message_type)s")
    if kind == "inbox":
        write = f"recorded AS ({record} WHERE {part.precondition} RETURNING 1)"
    else:
        if kind == "create":
            change = (f"INSERT INTO {aggregates} (aggregate_type, aggregate_id, version, "
                      "state, state_version, updated_at, completed) SELECT %(type)s, %(id)s, "
                      "1, %(state)s, %(state_version)s, clock_timestamp(), %(completed)s "
                      f"WHERE {part.precondition} ON CONFLICT DO NOTHING RETURNING 1")
        else:
            change = (f"UPDATE {aggregates} SET state = %(state)s, version = version + 1, "
                      "state_version = %(state_version)s, updated_at = clock_timestamp(), "
                      "completed = %(completed)s WHERE aggregate_type = %(type)s AND "
                      f"aggregate_id = %(id)s AND version = %(version)s AND {part.precondition}"
                      " RETURNING 1")
        write = f"changed AS ({change}), recorded AS ({record} FROM changed RETURNING 1)"
    return (f"WITH {part.inputs}, {write}, {part.effects(RECORDED)} "
            f"SELECT (SELECT count(*) FROM recorded), {part.precondition}, {part.result}")
