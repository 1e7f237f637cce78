"""Reading back the messages a test's handlers sent, by their wire names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, overload

import pydantic

from .. import headers as h
from ..envelope import Envelope
from ..messages import Message, is_message_type, message_name


def message_types_named(name: str) -> list[type[Message]]:
    """Every message class defined so far whose wire name is ``name``, oldest first."""
    found: list[type[Message]] = []
    pending: list[type[Any]] = [Message]
    while pending:
        cls = pending.pop(0)
        pending.extend(cls.__subclasses__())
        if is_message_type(cls) and message_name(cls) == name and cls not in found:
            found.append(cls)
    return found


@overload
def decoded(envelope: Envelope, preferred: Iterable[type[Message]] = (), *,
            strict: Literal[True]) -> Message: ...


@overload
def decoded(envelope: Envelope, preferred: Iterable[type[Message]] = (), *,
            strict: bool = False) -> Message | None: ...


def decoded(envelope: Envelope, preferred: Iterable[type[Message]] = (), *,
            strict: bool = False) -> Message | None:
    """The message ``envelope`` carries: the body read as the first class named like its
    type that it fits, ``preferred`` classes first (an endpoint's own), then every message
    class defined (tests may define several classes of one name). ``None`` if none fits;
    with ``strict``, ``LookupError`` instead."""
    name = envelope.headers.get(h.MESSAGE_TYPE, "")
    candidates = [cls for cls in preferred if message_name(cls) == name]
    candidates += [cls for cls in message_types_named(name) if cls not in candidates]
    for cls in candidates:
        try:
            return cls.model_validate_json(envelope.body)
        except pydantic.ValidationError:
            continue
    if strict:
        raise LookupError(f"no message class named {name!r} reads the body {envelope.body!r}")
    return None


class ByIntent:
    """``sent``, ``published`` and ``replied``: the messages a test's handlers put out, by
    intent, as the subclass's ``_of`` finds them."""

    def _of(self, intent: h.Intent) -> list[Message]:
        raise NotImplementedError

    @property
    def sent(self) -> list[Message]:
        """The commands sent (deferred ones too)."""
        return self._of(h.Intent.SEND)

    @property
    def published(self) -> list[Message]:
        """The events published."""
        return self._of(h.Intent.PUBLISH)

    @property
    def replied(self) -> list[Message]:
        """The replies sent."""
        return self._of(h.Intent.REPLY)
