"""Turning a delivery into a message, or into the reason it cannot be one."""

from __future__ import annotations

from collections.abc import Mapping

import pydantic

from . import headers as h
from .errors import InvalidMessage, MalformedMessage
from .messages import Message
from .registry import MessageRegistry

_JSON_MEDIA_TYPES = ("", h.CONTENT_TYPE)


def decode(
    headers: Mapping[str, str], body: bytes, content_type: str | None, registry: MessageRegistry
) -> Message:
    """Validate the headers and body of an incoming message and build the message.

    Raises ``MalformedMessage``, ``UnknownMessageType`` or ``InvalidMessage`` with a
    reason a person can act on.
    """
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type not in _JSON_MEDIA_TYPES:  # parameters such as charset do not matter
        raise MalformedMessage(f"content type {content_type!r} is not {h.CONTENT_TYPE}")
    for required in (h.MESSAGE_ID, h.MESSAGE_TYPE):
        if not headers.get(required):
            raise MalformedMessage(f"the {required} header is missing")
    message_type = registry.resolve(headers[h.MESSAGE_TYPE])
    try:
        return message_type.model_validate_json(body)
    except pydantic.ValidationError as exc:
        if any(error["type"] == "json_invalid" for error in exc.errors()):
            raise MalformedMessage(f"the body is not valid JSON: {_first_error(exc)}") from exc
        raise InvalidMessage(
            f"the body does not match {headers[h.MESSAGE_TYPE]}: {_summary(exc)}"
        ) from exc


def _first_error(exc: pydantic.ValidationError) -> str:
    return str(exc.errors()[0].get("msg", exc))


def _summary(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()
    )
