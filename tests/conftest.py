"""Shared test setup: everything offline, helpers to run the CLI for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# A slip that tries the network fails fast instead of hanging.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)


def run_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 300
):
    """Run ``python -m effitrain ARGS`` in a fresh process; return the CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if k != "EFFITRAIN_DEBUG"}
    full_env.update({**OFFLINE, "COLUMNS": "200", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "effitrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=timeout,
    )


def assert_clean_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """A user error: non-zero exit, one 'error:' line on stderr naming the problem, no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]
    return error_lines[0]


@pytest.fixture
def cli():
    return run_cli
