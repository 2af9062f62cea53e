"""Every script in examples/ runs."""

import pathlib
import subprocess
import sys

import pytest

# Version-independent (the example scripts, whose API paths the unit tests cover everywhere): run in CI's whole-suite
# environments only.
pytestmark = pytest.mark.version_independent

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script):
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
