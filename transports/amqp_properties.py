"""idembus's core headers as AMQP basic properties.

py-amqp writes the headers table item by item, each name and value with its type tag,
and reads it back the same way; the basic properties (``message_id``, ``type``, ...) are
fixed fields of the content header, a flag bit and a short string each. On RabbitMQ the
kombu transport therefore carries five core headers as properties (:data:`CORE`):

========================================  ====================
header                                    property
========================================  ====================
``idembus.message_id``                    ``message_id``
``idembus.message_type``                  ``type``
``idembus.correlation_id``                ``correlation_id``
``idembus.reply_to``                      ``reply_to``
``idembus.originating_endpoint``          ``app_id``
========================================  ====================

A value whose UTF-8 form is longer than a short string's 255 bytes stays in the table.
Reading takes both shapes: a property fills its header when the table does not have that
header, so that a message whose table has it (an older idembus, a producer following the
earlier wire format, a copy in the error queue or a delay level) reads as before, and the
table wins where both are present. ``idembus.time_sent`` stays a header: AMQP's
``timestamp`` holds whole seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import headers as h

#: (header, AMQP basic property) of the headers carried as properties on RabbitMQ.
CORE: tuple[tuple[str, str], ...] = (
    (h.MESSAGE_ID, "message_id"),
    (h.MESSAGE_TYPE, "type"),
    (h.CORRELATION_ID, "correlation_id"),
    (h.REPLY_TO, "reply_to"),
    (h.ORIGINATING_ENDPOINT, "app_id"),
)
#: The names of those properties.
NAMES = frozenset(name for _, name in CORE)
#: The longest short string AMQP carries, in bytes.
SHORTSTR_MAX = 255


def split(headers: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``headers`` as what goes into the headers table and what goes into properties
    (by property name). ``headers`` is left as it is."""
    table = dict(headers)
    properties: dict[str, str] = {}
    for header, name in CORE:
        value = table.get(header)
        if value is not None and _fits(value):
            properties[name] = value
            del table[header]
    return table, properties


def merged(headers: Mapping[Any, Any], properties: Mapping[str, Any] | None
           ) -> Mapping[Any, Any]:
    """The headers of a received message: its table, and each core property whose header
    the table does not have (:data:`CORE`). ``headers`` itself when no property adds one;
    never changed in place."""
    if not properties:
        return headers
    added: dict[Any, Any] | None = None
    for header, name in CORE:
        value = properties.get(name)
        if value is None or header in headers:
            continue
        if added is None:
            added = dict(headers)
        added[header] = value
    return headers if added is None else added


def carried(properties: Mapping[str, Any] | None) -> dict[str, Any]:
    """The core properties of a received message, to publish a copy of it with them."""
    if not properties:
        return {}
    return {name: properties[name] for _, name in CORE if properties.get(name) is not None}


def _fits(value: str) -> bool:
    """Whether ``value`` can be a short string: at most 255 bytes of UTF-8 (a value with
    surrogates, which a short string would not carry as they are, stays in the table)."""
    if len(value) > SHORTSTR_MAX:
        return False
    if value.isascii():
        return True
    try:
        return len(value.encode("utf-8")) <= SHORTSTR_MAX
    except UnicodeEncodeError:
        return False
