"""Values from the wire made fit for a log line: escaped and bounded.

A message id, a type name or any header value comes from whoever published the message.
Written raw, a newline in it forges a log line of the sender's choosing, an escape
sequence rewrites an operator's terminal, and a 70 KB type name fills the log. Every line
idembus writes about an incoming message passes such values through :func:`loggable`.
"""

from __future__ import annotations

#: Longest value a log line carries, in characters (a uuid has 36).
LIMIT = 200
_CUT = "…"


def loggable(value: object, limit: int = LIMIT) -> str:
    """``value`` as a log line may carry it: unchanged when it is printable text of at most
    ``limit`` characters; otherwise quoted and escaped as ``repr`` does (line breaks,
    control and format characters as ``\\n``, ``\\x1b``, ``\\u2028``), cut at ``limit``
    characters with an ellipsis and its full length: ``'xxxx…' (70000 characters)``."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit and text.isprintable():
        return text
    shown = repr(text[:limit])
    quote, inner = shown[0], shown[1:-1]
    if len(text) <= limit and len(inner) <= limit:
        return shown
    return f"{quote}{inner[:limit]}{_CUT}{quote} ({len(text)} characters)"
