"""The linter's findings fail the suite: ruff, configured in pyproject.toml (lint and import order)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
  ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
  if ruff is None:
    pytest.fail('ruff is not installed: `pip install -e ".[all]"` installs it (the test extra)')
  result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True)
  assert result.returncode == 0, result.stdout + result.stderr
