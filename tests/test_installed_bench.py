"""``python -m memshare bench`` works after a plain ``pip install .``, from any folder, without the clone.

Slow (a fresh virtual environment, a normal install with dependencies, a short benchmark run: about half a
minute here), but part of the suite: it is the only test that runs memshare as users install it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _copy_sources(destination: str) -> None:
    """The files git tracks (plus new ones not yet committed), without build leftovers or virtual environments."""
    ignore = shutil.ignore_patterns(".git", ".venv", ".ci-venvs", "build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(ROOT, destination, ignore=ignore)


@pytest.mark.version_independent
@pytest.mark.timeout(600)
def test_bench_after_plain_install_from_an_empty_folder(tmp_path):
    source, venv, empty = tmp_path / "src", tmp_path / "venv", tmp_path / "empty"
    _copy_sources(str(source))
    empty.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", str(source)], capture_output=True, text=True, timeout=480
    )
    assert install.returncode == 0, install.stderr[-3000:]
    shutil.rmtree(source)  # nothing may come from the sources any more

    def bench(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [python, "-m", "memshare", "bench", *options],
            cwd=str(empty),
            # The report goes to the temp folder: the test's own.
            env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TMPDIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=300,
        )

    result = bench("--size", "64M", "--workloads", "ad", "--repeats", "1", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| (a) | memshare | 2 |" in result.stdout and "| (a) | joblib | 2 |" in result.stdout
    assert "| (d) | memshare | 2 |" in result.stdout and "**NO**" not in result.stdout
    assert "memshare against the limit" in result.stdout
    # The bench extra is not installed here: what needs it says so, before running anything.
    plot = bench("--workloads", "h", "--plot", "sweep.png")
    assert plot.returncode == 2 and "needs matplotlib" in plot.stderr and "memshare[bench]" in plot.stderr
    grid = bench("--workloads", "g")
    assert grid.returncode == 2 and "needs scikit-learn" in grid.stderr
    assert os.listdir(empty) == []
    assert [name for name in os.listdir(tmp_path) if name.startswith("memshare-bench-")]  # the report, not in cwd
