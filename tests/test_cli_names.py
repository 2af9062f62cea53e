"""The command line names itself as invoked and reports its version."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import memshare
from memshare.__main__ import invoked_name


def run(command: list) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def console_script() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "memshare")
    if not os.path.exists(path):
        pytest.skip("the memshare console script is not installed next to this interpreter (pip install memshare)")
    return path


def test_version():
    for command in ([sys.executable, "-m", "memshare", "--version"], [console_script(), "--version"]):
        result = run(command)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"memshare {memshare.__version__}"


def test_usage_names_the_command_as_invoked():
    """``memshare --help`` says ``usage: memshare``; ``python -m memshare --help`` says ``python -m memshare``."""
    script = run([console_script(), "--help"])
    module = run([sys.executable, "-m", "memshare", "--help"])
    assert script.stdout.startswith("usage: memshare [-h]"), script.stdout
    assert module.stdout.startswith("usage: python -m memshare [-h]"), module.stdout
    bench = run([console_script(), "bench", "--help"])
    assert bench.stdout.startswith("usage: memshare bench"), bench.stdout
    error = run([console_script(), "clean", "--bogus"])
    assert error.returncode == 2 and error.stderr.startswith("usage: memshare ") and "memshare: error:" in error.stderr


@pytest.mark.parametrize(
    "argv0, name",
    [
        ("/venv/bin/memshare", "memshare"),
        ("/x/memshare/__main__.py", "python -m memshare"),
        ("-c", "python -m memshare"),
    ],
)
def test_invoked_name(argv0, name):
    assert invoked_name(argv0) == name
