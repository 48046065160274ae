"""The dependency rule, checked (issue 15): ``server`` -> ``tuner`` -> ``runtime``,
``records``; inside ``server``, frontend -> pool -> worker; the pool imports no HTTP framework;
nothing below ``server`` speaks HTTP; the record knows nothing of the backends. The contracts
live in pyproject.toml; import-linter, a tool made for this, checks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_import_contract_is_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    out = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout and out.stdout.count(" KEPT") >= 5
