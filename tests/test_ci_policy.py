"""An unreachable service skips its tests locally and fails them under CI=true."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLOSED = "amqp://guest:guest@127.0.0.1:1//"  # nothing listens on port 1


def run_smoke_test_on_amqp(ci: str | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IDEMBUS_AMQP_URL": CLOSED}
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "tests/test_smoke.py", "-k", "amqp"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def test_locally_an_unreachable_broker_skips_with_the_reason():
    done = run_smoke_test_on_amqp(ci=None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout
    assert "RabbitMQ is not reachable at 127.0.0.1:1" in done.stdout


def test_under_ci_an_unreachable_broker_fails_the_run():
    done = run_smoke_test_on_amqp(ci="true")
    assert done.returncode != 0
    assert "under CI=true every service must be up" in done.stdout


def test_the_ci_script_is_valid_bash_and_ends_by_running_make_test():
    # An edit once folded a block into the script's first comment, leaving an unclosed
    # backquote: bash refused the whole script and CI would have run no test at all.
    script = ROOT / ".ci" / "run"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    commands = [line.strip() for line in script.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == "make test"
