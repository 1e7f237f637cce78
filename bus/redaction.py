"""Secrets out of everything idembus says: one function every log line, error message, CLI
output, status row and HTTP body goes through when it may carry a connection string.

It knows the forms a secret takes in what idembus is configured with:

* URL userinfo — ``amqp://user:secret@host//``, ``redis://:secret@host:6379/0``,
  ``postgresql://user:secret@host/db`` (kombu and libpq URLs alike): the part after the
  first ``:`` of the userinfo becomes ``***``;
* ``key=value`` pairs of libpq conninfo strings and URL queries — ``password=secret``,
  ``password = 'with spaces and \\' quotes'``, ``?sslpassword=secret&...``;
* quoted mappings as ``repr`` prints them — ``{'password': 'secret'}``.

Redaction errs on the side of hiding: a string that merely looks like one of these loses
its value too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

MASK = "***"

_SECRET_KEYS = r"(?:ssl)?password|passwd|pwd|secret|token|api_?key"

#: ``scheme://user:secret@`` — the secret runs to the last ``@`` before white space.
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s/?#@:]*:)\S*@")
#: ``password=secret`` (libpq, URL queries), quoted or not, with or without spaces.
_KEY_VALUE = re.compile(
    rf"(?P<head>\b(?:{_SECRET_KEYS})\s*=\s*)"
    r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s&;,'\")]+)",
    re.IGNORECASE)
#: ``'password': 'secret'`` and ``"password": "secret"`` (dict reprs, JSON).
_QUOTED_PAIR = re.compile(
    rf"(?P<head>(?P<q>['\"])(?:{_SECRET_KEYS})(?P=q)\s*:\s*)"
    r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")",
    re.IGNORECASE)


def redact(text: str, *, secrets: Iterable[str] = ()) -> str:
    """``text`` with every password it carries replaced by ``***``; ``secrets`` are further
    values to hide wherever they appear (a gateway's basic-auth password)."""
    text = _USERINFO.sub(lambda m: f"{m['head']}{MASK}@", text)
    text = _KEY_VALUE.sub(lambda m: f"{m['head']}{MASK}", text)
    text = _QUOTED_PAIR.sub(lambda m: f"{m['head']}'{MASK}'", text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text


class RedactingFormatter(logging.Formatter):
    """A log formatter whose every line, traceback included, went through :func:`redact`:
    what drivers put in their exception messages is hidden as well as idembus's own."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))
