"""The one redaction function knows every form a password takes in idembus's configuration."""

from __future__ import annotations

import logging
import pathlib

import pytest

from idembus.redaction import MASK, RedactingFormatter, redact, redacted_traceback

SECRET = "Sup3r-s3cret"


@pytest.mark.parametrize("text", [
    f"amqp://guest:{SECRET}@127.0.0.1:5672//",
    f"amqps://guest:{SECRET}@broker.example/vhost?heartbeat=10",
    f"redis://:{SECRET}@127.0.0.1:6379/0",
    f"redis://user:{SECRET}@host:6379/0",
    f"postgresql://app:{SECRET}@db:5432/sales",
    f"postgresql://app:{SECRET}/with/slash@db:5432/sales",
    f"postgresql://app:p@{SECRET}@db:5432/sales",
    f"host=db user=app password={SECRET} dbname=sales",
    f"host=db password = {SECRET} dbname=sales",
    f"host=db password='{SECRET} with spaces' dbname=sales",
    f"host=db password='{SECRET}\\'quoted' dbname=sales",
    f'host=db password="{SECRET}" dbname=sales',
    f"postgresql://db/sales?user=app&password={SECRET}&sslmode=require",
    f"host=db sslpassword={SECRET}",
    f"HOST=db PASSWORD={SECRET}",
    f"options {{'password': '{SECRET}', 'ssl': True}}",
    f'{{"password": "{SECRET}"}}',
    f"cannot connect to amqp://guest:{SECRET}@127.0.0.1:5672//: [Errno 111] refused",
])
def test_a_password_in_any_known_form_is_masked(text: str) -> None:
    redacted = redact(text)

    assert SECRET not in redacted
    assert MASK in redacted


def test_a_raw_space_in_a_url_password_leaks_no_part_of_it() -> None:
    # Issue 24, finding 9: before, the line came out unchanged.
    redacted = redact("cannot connect to amqp://user:pa ss@host/: refused")
    assert redacted == "cannot connect to amqp://user:***@host/: refused"
    assert "pa" not in redacted.replace("amqp", "") and "ss@" not in redacted


def test_what_surrounds_a_password_stays_readable() -> None:
    assert redact(f"amqp://guest:{SECRET}@127.0.0.1:5672//") == "amqp://guest:***@127.0.0.1:5672//"
    assert (redact(f"host=db password='{SECRET} x' dbname=sales")
            == "host=db password=*** dbname=sales")
    assert redact("memory:// and redis://127.0.0.1:6379/0") == "memory:// and redis://127.0.0.1:6379/0"


@pytest.mark.parametrize("value", ["abc;TailSecret99", "ab,cd", "a\\'b", "ab)cd", "ab&cd",
                                   'ab"cd', "a\\ b", "'a b'\\''c'"])
def test_an_unquoted_libpq_value_is_masked_up_to_white_space(value: str) -> None:
    assert redact(f"host=db password={value} dbname=sales") == (
        "host=db password=*** dbname=sales")


def test_in_a_url_query_the_next_parameter_ends_the_password() -> None:
    assert redact("postgresql://db/x?password=ab;c&sslmode=require&user=app") == (
        "postgresql://db/x?password=***&sslmode=require&user=app")
    assert redact("postgresql://db/x?user=app&password=a&b") == (
        "postgresql://db/x?user=app&password=***")


@pytest.mark.parametrize(("text", "expected"), [
    ("PGPASSWORD=abc;def psql", "PGPASSWORD=*** psql"),
    ("export IDEMBUS_POSTGRES_PASSWORD='a b' ok", "export IDEMBUS_POSTGRES_PASSWORD=*** ok"),
    ("environ({'PGPASSWORD': 'x;y', 'HOME': '/root'})",
     "environ({'PGPASSWORD': '***', 'HOME': '/root'})"),
    ("mongodb://h/?tlsCertificateKeyFilePassword=x;y&tls=true",
     "mongodb://h/?tlsCertificateKeyFilePassword=***&tls=true"),
    ("mongodb://h/?authMechanismProperties=AWS_SESSION_TOKEN:t0k;en&authSource=$external",
     "mongodb://h/?authMechanismProperties=AWS_SESSION_TOKEN:***&authSource=$external"),
    ("Authorization: Basic b3BzOnB3", "Authorization: Basic ***"),
    ("{'Authorization': 'Bearer abc'}", "{'Authorization': '***'}"),
    ("Connection(password=b'x;y', api_key=k3y)", "Connection(password=*** api_key=***"),
    ("cannot be used: Port could not be cast to integer value as 'pw-part'. Use",
     "cannot be used: Port could not be cast to integer value as ***. Use"),
])
def test_environment_assignments_and_driver_spellings_are_masked(text: str,
                                                                 expected: str) -> None:
    assert redact(text) == expected


def test_a_quote_that_never_closes_hides_the_rest_of_its_line_only() -> None:
    assert redact("password='ab cd dbname=x\nnext line") == "password=***\nnext line"


def test_extra_secrets_are_hidden_wherever_they_appear() -> None:
    assert redact(f"basic auth admin {SECRET} refused", secrets=[SECRET, ""]) == (
        "basic auth admin *** refused")


def test_the_formatter_hides_passwords_in_messages_and_tracebacks() -> None:
    formatter = RedactingFormatter("%(message)s")
    try:
        raise ConnectionError(f"refused by postgresql://u:{SECRET}@db/x")
    except ConnectionError:
        record = logging.LogRecord("t", logging.ERROR, __file__, 1, "url %s", (
            f"amqp://u:{SECRET}@h//",), exc_info=__import__("sys").exc_info())

    line = formatter.format(record)

    assert SECRET not in line
    assert "ConnectionError" in line


def raised_from(path: pathlib.Path) -> BaseException:
    """An exception raised in a module whose file is ``path``."""
    path.write_text("def fail():\n    raise ValueError('boom')\n")
    namespace: dict[str, object] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    try:
        namespace["fail"]()  # type: ignore[operator]
    except ValueError as error:
        return error
    raise AssertionError("fail() did not raise")


def test_a_stored_stack_trace_names_files_by_their_place_on_sys_path_not_on_the_disk(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an application package under a deployment folder that is on sys.path
    app = tmp_path / "srv" / "deploy-7f3a" / "shop"
    app.mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "srv" / "deploy-7f3a"))

    # When a handler in it fails
    trace = redacted_traceback(raised_from(app / "payments.py"))

    # Then the trace names the module's file as it is imported, not where it lies
    assert 'File "shop/payments.py", line 2' in trace
    assert str(tmp_path) not in trace and "deploy-7f3a" not in trace


def test_a_file_outside_sys_path_keeps_only_its_last_two_parts(tmp_path: pathlib.Path) -> None:
    trace = redacted_traceback(raised_from(tmp_path / "script.py"))
    assert f'File "…/{tmp_path.name}/script.py"' in trace and str(tmp_path.parent) not in trace
