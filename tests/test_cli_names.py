"""The command line names itself as invoked and reports its version."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import memshare
from memshare.__main__ import invoked_name

# Version-independent (the command-line tools' names and help): run in CI's whole-suite environment (main) only.
pytestmark = pytest.mark.version_independent


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


def test_runs_beside_a_clone_named_memshare(tmp_path):
    """From the folder that holds a clone (a ``memshare/`` directory with the sources under ``src/``), the installed
    package is the one imported: the clone's root is no package, and nothing in it shadows memshare."""
    clone = tmp_path / "memshare"
    (clone / "src" / "memshare").mkdir(parents=True)
    (clone / "README.md").write_text("a clone\n")
    (clone / "src" / "memshare" / "__init__.py").write_text("raise ImportError('the clone was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for command in ([sys.executable, "-m", "memshare", "--version"], [sys.executable, "-m", "memshare", "doctor"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env)
        assert result.returncode in (0, 1), result.stderr  # doctor: 1 only when the machine has a problem
        assert "Traceback" not in result.stderr, result.stderr
    where = subprocess.run(
        [sys.executable, "-c", "import memshare; print(memshare.__file__, memshare.__version__)"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
        env=env,
    )
    assert where.returncode == 0 and where.stdout.split()[1] == memshare.__version__, where.stderr
    assert os.path.dirname(where.stdout.split()[0]) == os.path.dirname(memshare.__file__)
