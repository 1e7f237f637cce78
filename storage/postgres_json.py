"""JSON parameters of :class:`~idembus.storage.postgres.PostgresStorage` written quickly.

The rows a commit writes (its outgoing messages' records, headers and body as text) are
most of the JSON idembus sends PostgreSQL, and ``json.dumps`` escapes every character of
that text in a loop of its own. :func:`text_json` writes the same JSON document with
pydantic-core's encoder (compact, UTF-8 kept as is, which ``jsonb`` stores alike) and
falls back to ``json.dumps`` for what that encoder refuses (a lone surrogate), so that
PostgreSQL refuses it as before. It is meant for values idembus builds from text,
numbers, booleans and ``None``: an aggregate's state, the user's data, stays with
``json.dumps`` (:func:`row_with_state`), which refuses what JSON cannot hold.

The other way, every ``json`` and ``jsonb`` value read (a loaded state, a processed row's
outgoing messages and their ids) is parsed by pydantic-core's parser
(:func:`read_quickly`): the same values as ``json.loads`` for what PostgreSQL sends (valid
JSON, no duplicate keys in ``jsonb``), in a tenth of its time for small documents.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import psycopg
from psycopg.types.json import Jsonb, set_json_loads
from pydantic_core import PydanticSerializationError, from_json, to_json

#: ``json.dumps`` with its defaults, without its look at its arguments each call.
_STATE_ENCODER = json.JSONEncoder()


def text_json(value: Any) -> str:
    """``value`` (text, numbers, booleans, ``None``, in lists and dicts) as JSON text."""
    try:
        return to_json(value).decode()  # NaN and Infinity as json.dumps writes them
    except PydanticSerializationError:
        return json.dumps(value)


def row_with_state(row: Mapping[str, Any], state: Mapping[str, Any] | None) -> str:
    """``row`` (as :func:`text_json` writes it) with a ``state`` member: the aggregate's
    state as ``json.dumps`` writes it (``null`` for none)."""
    written = text_json(row)
    state_json = "null" if state is None else _STATE_ENCODER.encode(
        state if type(state) is dict else dict(state))
    return f'{written[:-1]},"state":{state_json}}}' if len(written) > 2 else (
        f'{{"state":{state_json}}}')


def written(text: str) -> str:
    """The dump function of :func:`jsonb`: the text is JSON already."""
    return text


def jsonb(text: str) -> Jsonb:
    """A ``jsonb`` parameter whose JSON text is ``text``, as written."""
    return Jsonb(text, dumps=written)


def jsonb_array(texts: Iterable[str]) -> Jsonb:
    """A ``jsonb`` array parameter of the JSON values ``texts``."""
    return Jsonb(f"[{','.join(texts)}]", dumps=written)


def read_quickly(connection: psycopg.Connection[Any]) -> None:
    """A connection pool's ``configure`` (of autocommit connections): ``connection`` reads
    ``json`` and ``jsonb`` values with pydantic-core's parser, and ``timestamptz`` values
    in UTC, the session's time zone (the same instants; psycopg converts a value to any
    other zone, ``Etc/UTC`` included, one by one, and idembus reads them in UTC)."""
    set_json_loads(from_json, connection)
    if connection.info.parameter_status("TimeZone") != "UTC":
        connection.execute("SET TIME ZONE 'UTC'")
