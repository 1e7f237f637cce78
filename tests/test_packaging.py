"""The wheel installs one top-level name, idembus, typed and licensed (the card's folders
map onto it in setup.cfg)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_wheel_holds_only_the_idembus_namespace_typed_and_licensed(
    tmp_path: pathlib.Path,
) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    [wheel] = tmp_path.glob("idembus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()

    tops = {name.split("/")[0] for name in names}
    assert tops == {"idembus", wheel.name.split("-py")[0] + ".dist-info"}
    for module in ("idembus/__init__.py", "idembus/__main__.py", "idembus/py.typed",
                   "idembus/handlers/__init__.py", "idembus/storage/postgres.py",
                   "idembus/transports/kombu.py", "idembus/gateway/server.py",
                   "idembus/spark/__init__.py", "idembus/dashboard/service.py",
                   "idembus/dashboard/static/dashboard.js",
                   "idembus/dashboard/static/dashboard.css"):
        assert module in names, module
    assert any(name.endswith("/LICENSE") for name in names)
