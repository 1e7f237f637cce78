"""A small Server-Sent Events client on the standard library (``http.client``), as a
service in another language would write one: it remembers the last id it received and
sends it back as ``Last-Event-ID`` when it reconnects."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamEvent:
    kind: str
    data: Any
    id: str | None


def stream(host: str, port: int, path: str = "/", *,
           last_event_id: str | None = None) -> Iterator[StreamEvent]:
    """The events of one connection, until the server closes it or the caller stops."""
    connection = http.client.HTTPConnection(host, port, timeout=30)
    headers = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    try:
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {response.read().decode()}")
        fields: dict[str, str] = {}
        data: list[str] = []
        while line := response.readline():
            text = line.decode("utf-8").rstrip("\r\n")
            if text == "":
                if data:
                    yield StreamEvent(fields.get("event", "message"),
                                      json.loads("\n".join(data)), fields.get("id"))
                fields, data = {}, []
            elif not text.startswith(":"):
                name, _, value = text.partition(":")
                value = value.removeprefix(" ")
                if name == "data":
                    data.append(value)
                else:
                    fields[name] = value
    finally:
        connection.close()
