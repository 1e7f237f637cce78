"""A minimal Server-Sent Events reader over httpx, for the gateway's tests: a real HTTP
client on a real socket, parsing the stream the way a browser's EventSource does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Received:
    """One event, or the ``retry:`` field (``kind == "retry"``)."""

    kind: str
    data: Any = None
    id: str | None = None


def events(response: httpx.Response) -> Iterator[Received]:
    """The events of a streaming response, until the server closes it. Keep the iterator
    while the stream should stay open: once it is dropped, httpx closes the connection (the
    gateway notices at once)."""
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield Received(fields.get("event", "message"), json.loads("\n".join(data)),
                               fields.get("id"))
            fields, data = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name == "retry":
            yield Received("retry", int(value))
        else:
            fields[name] = value


def take(stream: Iterator[Received], count: int) -> list[Received]:
    """The next ``count`` events (skipping ``retry``)."""
    taken: list[Received] = []
    for received in stream:
        if received.kind != "retry":
            taken.append(received)
            if len(taken) == count:
                break
    return taken
