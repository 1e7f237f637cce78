"""The gateway's HTTP basic authentication: where its credentials come from, and checking a
request's ``Authorization`` header against them.

Credentials are ``user:password`` (both non-empty), from the environment variable
:data:`AUTH_VARIABLE` or a file (``--auth-file``), never from the command line, where every
user of the machine can read them (``ps``). A variable that is set but empty is refused: it
usually means a secret that was not filled in, and serving without authentication would be
the wrong way to fail.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigurationError

log = logging.getLogger(__name__)

#: Environment variable holding ``user:password``.
AUTH_VARIABLE = "IDEMBUS_GATEWAY_AUTH"


@dataclass(frozen=True)
class Credentials:
    """A user and password; ``repr`` never shows the password."""

    user: str
    password: str = field(repr=False)

    @classmethod
    def parse(cls, text: str, source: str = "auth") -> Credentials:
        """``user:password``; :class:`~idembus.errors.ConfigurationError` naming ``source`` (but
        not the password) if either part is empty."""
        user, colon, password = text.strip("\r\n").partition(":")
        if not colon or not user or not password:
            raise ConfigurationError(
                f"{source} must be 'user:password' with neither part empty "
                f"({'no password' if colon and user else 'no user' if colon else 'no colon'})")
        return cls(user, password)

    def admit(self, header: str | None) -> bool:
        """True if ``header`` (a request's ``Authorization``) carries these credentials.
        Compared in constant time, whatever the length of what was sent."""
        if not header or not header[:6].lower() == "basic ":
            return False
        try:
            given = base64.b64decode(header[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        expected = f"{self.user}:{self.password}".encode()
        return hmac.compare_digest(hashlib.sha256(given).digest(),
                                   hashlib.sha256(expected).digest())


def load_credentials(auth_file: str | None,
                     environ: Mapping[str, str] | None = None) -> Credentials | None:
    """The gateway's credentials: from ``auth_file`` (its first line) if given, else from
    :data:`AUTH_VARIABLE`; ``None`` if neither is given."""
    environ = os.environ if environ is None else environ
    if auth_file is not None:
        try:
            with open(auth_file, encoding="utf-8") as file:
                mode = os.fstat(file.fileno()).st_mode
                first = file.readline()
        except OSError as error:
            raise ConfigurationError(
                f"--auth-file {auth_file}: cannot read it ({error.strerror})") from error
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("--auth-file %s can be read by other users of this machine "
                        "(chmod 600 it)", auth_file)
        return Credentials.parse(first, f"--auth-file {auth_file}")
    value = environ.get(AUTH_VARIABLE)
    if value is None:
        return None
    return Credentials.parse(value, f"${AUTH_VARIABLE}")
