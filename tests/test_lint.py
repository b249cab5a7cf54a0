"""The code stays formatted and lint-clean (issue 49): ``ruff check .`` and ``ruff format --check .``
from the repository root, with the settings of pyproject.toml's ``[tool.ruff]``. A failure prints
ruff's own report; ``ruff format .`` and ``ruff check --fix .`` fix most of it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_finds_nothing(command):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout}{result.stderr}"
