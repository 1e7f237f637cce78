"""No password survives redact(), whatever characters it holds, in any form a connection
string gives it: generated passwords (every punctuation character, white space and
non-ASCII letters among them) written as each form writes them.

"Survives" is checked strictly: what precedes the password comes out unchanged and
followed by the mask, and everything after the mask is a tail of what followed the
password in the original text — not one character of the password is left, wherever the
redaction stopped.
"""

from __future__ import annotations

import json
import shlex
import string
import urllib.parse

from hypothesis import example, given, settings
from hypothesis import strategies as st

from idembus.redaction import MASK, redact

#: Every ASCII punctuation character in one password, the case each form must get right.
EVERY_PUNCTUATION = f"Pw{string.punctuation}End"

_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \tÄßλ€"
passwords = st.text(alphabet=_ALPHABET, min_size=1, max_size=40)
#: Passwords a form cannot carry raw if they hold white space (URLs, environment words).
words = st.text(alphabet=_ALPHABET.replace(" ", "").replace("\t", ""), min_size=1,
                max_size=40)

URL_PLACES = [
    ("amqp", "guest", "127.0.0.1:5672", "//"),
    ("amqps", "app", "broker.example", "/vhost?heartbeat=10"),
    ("redis", "", "127.0.0.1:6379", "/0"),
    ("redis", "default", "cache.example:6380", "/1"),
    ("rediss", "", "cache.example", "/0?ssl_cert_reqs=required"),
    ("postgresql", "app", "db:5432", "/sales?sslmode=require"),
    ("mongodb", "root", "h1:27017,h2:27018,h3", "/db?replicaSet=rs&authSource=admin"),
    ("mongodb+srv", "app", "cluster0.example.net", "/?retryWrites=true"),
]
places = st.sampled_from(URL_PLACES)
surroundings = st.sampled_from([("", ""), ("cannot connect to ", ": [Errno 111] refused"),
                                ("url '", "' refused"), ("(", ")")])


def assert_masked(before: str, secret: str, after: str) -> None:
    """``before + secret + after`` redacts to ``before``, the mask, and a tail of
    ``after``: nothing of ``secret`` is left."""
    redacted = redact(before + secret + after)
    assert redacted.startswith(redact(before) + MASK), (before + secret + after, redacted)
    rest = redacted[len(redact(before) + MASK):]
    assert after.endswith(rest), (before + secret + after, redacted)
    assert redact(redacted) == redacted  # messages are often redacted twice


@settings(max_examples=300)
@given(password=passwords, place=places, around=surroundings)
@example(password=EVERY_PUNCTUATION, place=URL_PLACES[0], around=("", ""))
def test_a_percent_encoded_password_in_url_userinfo_never_survives(
    password: str, place: tuple[str, str, str, str], around: tuple[str, str],
) -> None:
    scheme, user, hosts, tail = place
    assert_masked(f"{around[0]}{scheme}://{user}:", urllib.parse.quote(password, safe=""),
                  f"@{hosts}{tail}{around[1]}")


@settings(max_examples=300)
@given(password=words, place=places)
@example(password=EVERY_PUNCTUATION, place=URL_PLACES[5])
@example(password="p@ss:w/rd?#x", place=URL_PLACES[2])
def test_a_raw_password_in_url_userinfo_never_survives(
    password: str, place: tuple[str, str, str, str],
) -> None:
    # Raw ``/ ? # @ :`` make the URL invalid, but a driver or an operator may write it so
    scheme, user, hosts, tail = place
    assert_masked(f"{scheme}://{user}:", password, f"@{hosts}{tail}")


@settings(max_examples=300)
@given(password=passwords.filter(lambda text: " " in text or "\t" in text),
       place=places, around=surroundings)
@example(password="pa ss", place=URL_PLACES[0], around=("", ""))
@example(password=" lead and trail\t", place=URL_PLACES[5], around=("cannot connect to ", ""))
@example(password="://\x20", place=URL_PLACES[0], around=("", ""))  # found by hypothesis
def test_a_raw_password_with_white_space_in_url_userinfo_never_survives(
    password: str, place: tuple[str, str, str, str], around: tuple[str, str],
) -> None:
    # Issue 24, finding 9: the secret ran to the last "@" before white space, so
    # amqp://user:pa ss@host/ kept "pa ss" whole (no "@" before the space: no match).
    scheme, user, hosts, tail = place
    assert_masked(f"{around[0]}{scheme}://{user}:", password, f"@{hosts}{tail}{around[1]}")


@settings(max_examples=300)
@given(password=passwords, last=st.booleans())
@example(password=EVERY_PUNCTUATION, last=False)
def test_a_password_in_a_url_query_never_survives(password: str, last: bool) -> None:
    after = "" if last else "&sslmode=require"
    assert_masked("postgresql://db:5432/sales?user=app&password=",
                  urllib.parse.quote(password, safe=""), after)


@settings(max_examples=300)
@given(password=words.filter(lambda word: "&" not in word))
@example(password=EVERY_PUNCTUATION.replace("&", ""))
def test_a_raw_password_in_a_url_query_never_survives(password: str) -> None:
    assert_masked("mongodb://h1,h2/db?tlsCertificateKeyFilePassword=", password,
                  "&tls=true")


def libpq_unquoted(value: str) -> str:
    """``value`` as an unquoted libpq value: backslash before backslashes, white space and
    quotes (libpq reads ``\\x`` as ``x``)."""
    return "".join(f"\\{c}" if c in "\\'\" \t" else c for c in value)


def libpq_quoted(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


@settings(max_examples=300)
@given(password=passwords, key=st.sampled_from(["password", "sslpassword", "PASSWORD"]),
       spaced=st.booleans(), last=st.booleans())
@example(password=EVERY_PUNCTUATION, key="password", spaced=False, last=False)
@example(password="abc;TailSecret99", key="password", spaced=False, last=False)
def test_an_unquoted_libpq_password_never_survives(
    password: str, key: str, spaced: bool, last: bool,
) -> None:
    equals = " = " if spaced else "="
    assert_masked(f"host=db user=app {key}{equals}", libpq_unquoted(password),
                  "" if last else " dbname=sales connect_timeout=1")


@settings(max_examples=300)
@given(password=words.filter(lambda word: not word.startswith(("'", '"'))))
@example(password=r"ab,cd;ef)gh\'ij")
def test_an_unquoted_libpq_password_written_without_escapes_never_survives(
    password: str,
) -> None:
    # Quotes and backslashes inside an unquoted value, as people write them: libpq takes
    # a quote there literally; white space alone ends the value
    assert_masked("host=db password=", password, " dbname=sales")


@settings(max_examples=300)
@given(password=passwords, spaced=st.booleans(), last=st.booleans())
@example(password=EVERY_PUNCTUATION + " with spaces", spaced=True, last=False)
@example(password="\\", spaced=False, last=False)
def test_a_quoted_libpq_password_never_survives(password: str, spaced: bool,
                                               last: bool) -> None:
    equals = " = " if spaced else "="
    assert_masked(f"host=db password{equals}", libpq_quoted(password),
                  "" if last else " dbname=sales")


@settings(max_examples=300)
@given(password=passwords, key=st.sampled_from(
    ["PGPASSWORD", "IDEMBUS_POSTGRES_PASSWORD", "REDIS_PASSWORD", "MONGO_SECRET"]))
@example(password=EVERY_PUNCTUATION, key="PGPASSWORD")
def test_a_password_in_a_shell_assignment_never_survives(password: str, key: str) -> None:
    assert_masked(f"env {key}=", shlex.quote(password), " psql -h db")


@settings(max_examples=300)
@given(password=words, key=st.sampled_from(["PGPASSWORD", "pgpassword", "export PGPASSWORD"]))
@example(password="abc;TailSecret99", key="PGPASSWORD")
def test_a_password_in_an_environment_word_never_survives(password: str, key: str) -> None:
    assert_masked(f"{key}=", password, " next")


@settings(max_examples=300)
@given(password=passwords, key=st.sampled_from(["password", "PGPASSWORD", "api_key"]))
@example(password=EVERY_PUNCTUATION, key="password")
@example(password="db", key="password")
def test_a_password_in_a_mapping_repr_or_json_never_survives(password: str, key: str) -> None:
    mapping = {"host": "db", key: password, "port": 5432}
    for text, quoted in ((repr(mapping), f"'{key}': {password!r}"),
                         (json.dumps(mapping), f'"{key}": {json.dumps(password)}'),
                         (repr({key: password.encode()}), f"'{key}': {password.encode()!r}")):
        masked = quoted[:quoted.index(":") + 2] + f"'{MASK}'"
        assert redact(text) == text.replace(quoted, masked), text
