"""What a handler knows about the message it is handling."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from . import headers as h

#: Namespace of the uuid5 ids idembus derives (outgoing ids, idempotency keys).
IDEMBUS_NAMESPACE = uuid.UUID("6f1c1d7e-3c53-5a0b-9a0e-3e1d2b0a9c11")
_NAMESPACE_BYTES = IDEMBUS_NAMESPACE.bytes


#: The hex digit of a uuid's variant nibble (``8``-``b``, RFC 4122) for each hex digit of
#: the digest there: its two low bits kept, its two high bits ``10``.
_VARIANT_DIGIT = {digit: "89ab"[int(digit, 16) & 0x3] for digit in "0123456789abcdef"}


def derived_id(name: str) -> str:
    """``str(uuid.uuid5(IDEMBUS_NAMESPACE, name))``, without building a ``UUID``: the same
    SHA-1, its first 16 bytes in hex with the version digit (``5``) and the variant digit
    put in place of theirs (once per outgoing message and per idempotency key)."""
    text = hashlib.sha1(_NAMESPACE_BYTES + name.encode("utf-8"),
                        usedforsecurity=False).hexdigest()
    return (f"{text[:8]}-{text[8:12]}-5{text[13:16]}-{_VARIANT_DIGIT[text[16]]}"
            f"{text[17:20]}-{text[20:32]}")


@dataclass(frozen=True)
class MessageContext:
    """The incoming message's headers and ids, as seen by one handler."""

    message_id: str
    message_type: str
    headers: Mapping[str, str]
    handler_name: str
    endpoint: str

    def __init__(self, message_id: str, message_type: str, headers: Mapping[str, str],
                 handler_name: str, endpoint: str) -> None:
        # The frozen dataclass's own __init__ sets each field with object.__setattr__; one
        # update of the instance's dict does the same (once per handler and message).
        self.__dict__.update(message_id=message_id, message_type=message_type,
                             headers=headers, handler_name=handler_name, endpoint=endpoint)

    @property
    def dedup_key(self) -> str:
        """The key under which this handler's processing of this message is recorded."""
        return f"{self.handler_name}/{self.message_id}"

    @property
    def idempotency_key(self) -> str:
        """A key to pass to external systems (payment APIs...) so that a handler re-run
        after a crash does not repeat their effect. Stable per (handler, message)."""
        return derived_id(self.dedup_key)

    @property
    def correlation_id(self) -> str:
        """``idembus.correlation_id``, or this message's id when it starts a conversation."""
        return self.headers.get(h.CORRELATION_ID) or self.message_id

    @property
    def conversation_id(self) -> str:
        """``idembus.conversation_id``, or this message's id when it is the first."""
        return self.headers.get(h.CONVERSATION_ID) or self.message_id

    @property
    def reply_to(self) -> str | None:
        """The queue replies go to (``idembus.reply_to``), or None."""
        return self.headers.get(h.REPLY_TO) or None

    def outgoing_id(self, index: int) -> str:
        """Deterministic id of this handler's ``index``-th outgoing message.

        Derived from the incoming id, the handler and the position, so a handler re-run
        after a crash before commit produces the same ids, and two handlers of one event
        never produce the same id.
        """
        return derived_id(f"{self.handler_name}/{self.message_id}/{index}")
