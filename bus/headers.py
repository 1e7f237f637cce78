"""Header names of the wire format (README, "Wire format").

Every header is a string. A JSON message published by any client with at least
``MESSAGE_ID`` and ``MESSAGE_TYPE`` is processed exactly like one sent by idembus.
"""

from __future__ import annotations

import enum

MESSAGE_ID = "idembus.message_id"
MESSAGE_TYPE = "idembus.message_type"
CORRELATION_ID = "idembus.correlation_id"
CONVERSATION_ID = "idembus.conversation_id"
CAUSATION_ID = "idembus.causation_id"
REPLY_TO = "idembus.reply_to"
ORIGINATING_ENDPOINT = "idembus.originating_endpoint"
TIME_SENT = "idembus.time_sent"
INTENT = "idembus.intent"
#: The version of the body's shape (``message_version=`` of the message class); a message
#: without it is version 1.
MESSAGE_VERSION = "idembus.message_version"
#: What the message is: the wire names of its class and of the message types it derives
#: from, most derived first, comma-separated; each followed by ``:N`` where its version N is
#: above 1 (:mod:`idembus.hierarchy`).
ENCLOSED_TYPES = "idembus.enclosed_types"
#: ISO 8601 UTC time before which the message must not be delivered (deferred messages,
#: delayed retries).
DELIVER_AT = "idembus.deliver_at"
#: ISO 8601 UTC time after which the message is worthless: an endpoint receiving it later
#: acknowledges it unhandled (``discarded``), unless a handler already processed it
#: (``bus.send(..., discard_after=...)``, :mod:`idembus.expiry`).
DISCARD_AFTER = "idembus.discard_after"
#: Comma-separated references an event names for filtering (``Event.journal_parents``);
#: only on events that name some.
PARENTS = "idembus.parents"
#: On the messages of recurring schedules (``Endpoint(schedules=...)``): the schedule's name
#: and the occurrence's time (ISO 8601 UTC) the message was sent for.
SCHEDULE = "idembus.schedule"
OCCURRENCE = "idembus.occurrence"
#: On a timeout an aggregate handler requested (``request_timeout``): the aggregate it is
#: for, ``<aggregate type>/<aggregate id>``. Arriving once that aggregate was completed, it
#: is dropped.
SAGA_TIMEOUT = "idembus.saga_timeout"
#: On a request someone waits for (``bus.request``), and on the replies to it: a reply
#: whose requester is gone (its reply queue no longer exists) is dropped, not parked; a
#: request that fails for good answers with a failure reply (:mod:`idembus.requesting`).
AWAITED = "idembus.awaited"
#: On a claim-checked message (:mod:`idembus.storage.claims`): the id its body is kept
#: under in the payload store, and the body's size in bytes. The wire body is then a small
#: JSON reference; the receiver reads the body from the store before decoding.
CLAIM_CHECK = "idembus.claim_check"
CLAIM_CHECK_BYTES = "idembus.claim_check.bytes"
#: On a message some of whose fields are claim-checked (``ClaimCheck(fields=...)``): a JSON
#: object naming each such field's payload, ``{"<field>": {"id": "<id>", "bytes": <size>}}``;
#: in the body each of them is replaced by ``{"idembus.claim_check": "<id>", "bytes": <size>}``.
CLAIM_CHECK_FIELDS = "idembus.claim_check.fields"
#: On an error-queue copy of a claim-checked message: the hold that keeps its body in the
#: payload store until the copy is retried or purged (a failure header: a retry drops it).
CLAIM_CHECK_HOLD = "idembus.claim_check.hold"
#: On a command of an ordered type (``ordered_by=``): its ordering key, the partition the
#: sender chose for it (``blake2b(key) mod partitions``, :func:`idembus.messages.partition_of`)
#: and the number of partitions. Messages with the same key are handled one at a time, in
#: the order they were sent.
ORDERING_KEY = "idembus.ordering.key"
PARTITION = "idembus.ordering.partition"
PARTITIONS = "idembus.ordering.partitions"

# Written when a message is moved to the error queue.
EXCEPTION_TYPE = "idembus.exception.type"
EXCEPTION_MESSAGE = "idembus.exception.message"
STACK_TRACE = "idembus.exception.stack_trace"
FAILED_QUEUE = "idembus.failed_queue"
TIME_OF_FAILURE = "idembus.time_of_failure"
IMMEDIATE_ATTEMPTS = "idembus.attempts.immediate"
DELAYED_ATTEMPTS = "idembus.attempts.delayed"
#: How often in a row middleware or a handler postponed the message (``RetryLater``).
POSTPONEMENTS = "idembus.attempts.postponed"
#: The rate limits whose slot a postponed message reserved and holds (a JSON list of
#: names): coming back at that slot, it is not charged again
#: (``idembus.runtime.recoverability.limits``).
LIMITS_RESERVED = "idembus.limits.reserved"

CONTENT_TYPE = "application/json"


class Intent(str, enum.Enum):
    """Why a message was put on the wire."""

    SEND = "send"
    PUBLISH = "publish"
    REPLY = "reply"
