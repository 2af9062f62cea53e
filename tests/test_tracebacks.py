"""Worker tracebacks name the file and show the source line, for functions of ``__main__`` too."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import memshare


def fails(x):
    raise ValueError(f"bad {x}")  # the line to find


def main(kind):
    try:
        if kind == "pool":
            with memshare.MemmappingPool(1) as pool:
                pool.apply(fails, (1,))
        else:
            memshare.Parallel(n_jobs=2)(memshare.delayed(fails)(x) for x in range(2))
    except ValueError as exc:
        print(exc.__cause__)


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
"""


@pytest.mark.parametrize("kind", ["pool", "parallel"])
def test_remote_traceback_of_a_main_function_names_its_file_and_line(tmp_path, shm_dir, kind):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result = subprocess.run(
        [sys.executable, str(script), kind], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert f'File "{script}", line 6, in fails' in result.stdout
    assert 'raise ValueError(f"bad {x}")  # the line to find' in result.stdout
    assert "<dynamic-code>" not in result.stdout
