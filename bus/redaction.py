"""Secrets out of everything idembus says: one function every log line, error message, CLI
output, status row and HTTP body goes through when it may carry a connection string.

It knows the forms a secret takes in what idembus is configured with, and in what its
drivers (kombu, redis, psycopg, pymongo) put in their messages:

* URL userinfo — ``amqp://user:secret@host//``, ``redis://:secret@host:6379/0``,
  ``postgresql://user:secret@host/db``, ``mongodb://user:secret@h1,h2/db`` (raw or
  percent-encoded): everything between the first ``:`` of the userinfo and the last ``@``
  of its line (before any further ``scheme://``) becomes ``***`` — a raw space in a
  password does not end it;
* URL query parameters — ``?user=app&password=secret&sslmode=require``: the value runs to
  the ``&`` that starts the next parameter;
* libpq ``key=value`` pairs and environment assignments — ``password=secret``,
  ``password = 'with spaces and \\' quotes'``, ``PGPASSWORD=secret``: as libpq reads
  them, an unquoted value runs to white space (a backslash escapes the next character,
  white space included) and a quoted one to its closing quote;
* quoted mappings as ``repr`` and JSON print them — ``{'password': 'secret'}``,
  ``environ({'PGPASSWORD': ...})``;
* HTTP credentials — ``Authorization: Basic ...``, and pymongo's
  ``AWS_SESSION_TOKEN:...``;
* what :mod:`urllib.parse` says of a URL whose raw password holds ``/ ? # ;`` (kombu splits
  failover URLs at ``;``): ``Port could not be cast to integer value as 'part-of-it'``.

A key is secret when its name contains one of ``password``, ``passwd``, ``passphrase``,
``pwd``, ``secret``, ``token``, ``api_key``, ``credential``, ``private_key``,
``access_key`` or ``authorization`` (any case: ``sslpassword``, ``PGPASSWORD``,
``tlsCertificateKeyFilePassword``). Redaction errs on the side of hiding: a string that
merely looks like one of these loses its value too.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from collections.abc import Iterable

MASK = "***"

_KEY_WORDS = (r"password|passwd|passphrase|pwd|secret|token|api_?key|credentials?"
              r"|private_?key|access_?key|authorization")
#: A key whose name contains a secret word, with what surrounds it in the name (bounded:
#: a long word must not cost quadratic time).
_KEY = rf"[\w.\-]{{0,40}}(?:{_KEY_WORDS})[\w.\-]{{0,40}}"
#: White space as libpq sees it (ASCII ``isspace``): the only end of an unquoted value.
_SPACE = r" \t\n\r\f\v"

#: ``scheme://user:secret@`` — the secret runs to the last ``@`` of its line before another
#: ``scheme://`` (a raw space in a password, ``amqp://user:pa ss@host/``, does not end it),
#: or, when there is none such, to the last ``@`` before white space, or else (a password
#: holding ``://`` and a space) to the last ``@`` of the line: hiding too much, not too little.
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]{0,30}://[^\s/?#@:]*:)"
                       r"(?:(?:(?!://)[^\n])*|\S*|[^\n]*)@")
#: ``?password=secret&...`` — in a URL query, ``&key=`` starts the next parameter.
_QUERY_PAIR = re.compile(
    rf"(?<=[?&])(?P<head>{_KEY}=)(?:[^\s&]|&(?![^\s&=]*=))+", re.IGNORECASE)
#: ``password=secret`` anywhere else (libpq, environment, keyword arguments). As libpq reads
#: it: a value opening with a quote runs to its closing quote (backslash escapes), any other
#: to white space (a backslash escapes the next character, white space too). Erring on the
#: side of hiding: quoted segments later in the value are skipped whole (shell quoting:
#: ``'a'\''b'``), and a value opening with a quote that never closes runs to the end of
#: its line.
_KEY_VALUE = re.compile(
    rf"(?<![\w.\-?&])(?P<head>{_KEY}[ \t]*=[ \t]*)"
    r"(?:'(?!(?:[^'\\]|\\[\s\S])*')[^\n]*|\"(?!(?:[^\"\\]|\\[\s\S])*\")[^\n]*"
    r"|(?:'(?:[^'\\]|\\[\s\S])*'|\"(?:[^\"\\]|\\[\s\S])*\""
    rf"|\\[\s\S]?|[^{_SPACE}\\])+)",
    re.IGNORECASE)
#: ``'password': 'secret'`` and ``"password": "secret"`` (dict reprs, JSON).
_QUOTED_PAIR = re.compile(
    rf"(?P<head>(?P<q>['\"]){_KEY}(?P=q)\s*:\s*)"
    r"(?:b?'(?:[^'\\]|\\.)*'|b?\"(?:[^\"\\]|\\.)*\")",
    re.IGNORECASE)
#: ``Authorization: Basic secret`` (HTTP headers as logged).
_AUTHORIZATION = re.compile(
    r"(?P<head>\b(?:proxy-)?authorization[ \t]*:[ \t]*"
    r"(?:(?:basic|bearer|digest|negotiate|token)[ \t]+)?)[^\s'\",]+",
    re.IGNORECASE)
#: pymongo's ``authMechanismProperties=AWS_SESSION_TOKEN:secret``.
_SESSION_TOKEN = re.compile(r"(?P<head>\bAWS_SESSION_TOKEN:)[^\s&,]+", re.IGNORECASE)
#: urllib's ``Port could not be cast to integer value as 'x'``: ``x`` is what followed the
#: ``:`` of a URL cut short — a password with a raw ``/ ? # ;`` in it.
_BAD_PORT = re.compile(r"(?P<head>could not be cast to integer value as )(?:'[^'\n]*'|\S+)")


#: What every secret key's name holds, lower-cased (see :data:`_KEY_WORDS`).
_KEY_HINTS = ("pass", "pwd", "secret", "token", "key", "credential", "authorization")
#: Each pattern, in the order applied, with the lower-case strings a text holds one of if
#: the pattern may match it: a cheap test that spares most log lines the patterns.
_HINTS: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = (
    (_USERINFO, ("@",)),
    (_QUERY_PAIR, _KEY_HINTS),
    (_KEY_VALUE, _KEY_HINTS),
    (_AUTHORIZATION, ("authorization",)),
    (_SESSION_TOKEN, ("aws_session_token",)),
    (_BAD_PORT, ("integer value",)),
    (_QUOTED_PAIR, _KEY_HINTS),
)


def redact(text: str, *, secrets: Iterable[str] = ()) -> str:
    """``text`` with every password it carries replaced by ``***``; ``secrets`` are further
    values to hide wherever they appear (a gateway's basic-auth password)."""
    lowered = text.lower()
    for pattern, hints in _HINTS:
        if any(hint in lowered for hint in hints):
            text = pattern.sub(_masked, text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text


def _masked(match: re.Match[str]) -> str:
    """The head of a match, then the mask (quoted if the value was: a mapping's)."""
    if match.re is _USERINFO:
        return f"{match['head']}{MASK}@"
    if match.re is _QUOTED_PAIR:
        return f"{match['head']}'{MASK}'"
    return f"{match['head']}{MASK}"


class RedactingFormatter(logging.Formatter):
    """A log formatter whose every line, traceback included, went through :func:`redact`:
    what drivers put in their exception messages is hidden as well as idembus's own."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def redacted_traceback(error: BaseException) -> str:
    """``error``'s formatted traceback, passwords hidden (:func:`redact`): the last line
    repeats the exception's message, which may name a URL with its password. Each frame's
    file is named relative to the ``sys.path`` entry it was imported from
    (``idembus/runtime/processing.py``, ``shop/payments.py``), not by where the
    application or the checkout lies on the disk of the machine that failed; a file
    outside ``sys.path`` keeps its last two parts."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return redact(_FRAME_FILE.sub(lambda found: f'File "{_short_path(found.group(1))}"', text))


_FRAME_FILE = re.compile(r'File "([^"\n]+)"')


def _short_path(path: str) -> str:
    """``path`` relative to the longest ``sys.path`` entry holding it, else ``…/dir/file``."""
    if not os.path.isabs(path):
        return path  # "<string>", "<frozen ...>", already relative
    roots = [root.rstrip(os.sep) for root in sys.path if root and os.path.isabs(root)]
    holding = [root for root in roots if path.startswith(root + os.sep)]
    if holding:
        return path[len(max(holding, key=len)) + 1:]
    parts = path.split(os.sep)
    return os.sep.join(["…", *parts[-2:]])
