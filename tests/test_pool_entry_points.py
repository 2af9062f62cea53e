"""``MemmappingPool`` runs wherever the standard pool runs: scripts from a file, from standard input, from ``-c``.

Under forkserver and spawn a worker re-runs the parent's ``__main__`` from its file; a script piped to the
interpreter has no file (its ``__file__`` is ``'<stdin>'``), and must still work, with functions of ``__main__``
sent by value.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from memshare import MemmappingPool

    def add_one(x):
        return x + 1

    if __name__ == "__main__":
        with MemmappingPool(2, context={context!r}, maxtasksperchild={maxtasks}) as pool:
            print(pool.map(add_one, range(6)), pool.apply(add_one, (41,)))
            print([float(total) for total in pool.map(np.sum, [np.ones(300_000)] * 3)])
    """
)
EXPECTED = "[1, 2, 3, 4, 5, 6] 42\n[300000.0, 300000.0, 300000.0]\n"


def _run(argv, stdin=None):
    return subprocess.run(
        [sys.executable, *argv], input=stdin, capture_output=True, text=True, timeout=180, check=False
    )


@pytest.mark.parametrize("context", [None, "spawn", "fork"])
def test_a_script_piped_to_the_interpreter(context):
    # maxtasksperchild=1: replacement workers are started from the pool's own thread too.
    result = _run(["-"], stdin=SCRIPT.format(context=context, maxtasks=1))
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED
    assert "FileNotFoundError" not in result.stderr


@pytest.mark.parametrize("context", [None, "spawn"])
def test_a_script_given_with_dash_c(context):
    result = _run(["-c", SCRIPT.format(context=context, maxtasks=None)])
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED


@pytest.mark.parametrize("context", [None, "spawn"])
def test_a_script_file(tmp_path, context):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(context=context, maxtasks=None))
    result = _run([str(script)])
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED


def test_main_file_is_restored_after_workers_start():
    code = SCRIPT.format(context=None, maxtasks=1) + "\n    print(__file__)\n"
    result = _run(["-"], stdin=code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED + "<stdin>\n"


PRELOAD_SCRIPT = textwrap.dedent(
    """
    import multiprocessing
    import os
    import sys

    from memshare import MemmappingPool

    def where_am_i(_):
        # Under forkserver a worker is a child of the fork server: numpy in the server's maps means memshare's
        # preload reached it (numpy is on it for a parent that has numpy, imported below where the server's
        # import of this script does not run it); colorsys is the user's own preload, which must be kept.
        with open(f"/proc/{os.getppid()}/maps") as maps:
            server_has_numpy = "_multiarray_umath" in maps.read()
        return server_has_numpy, "colorsys" in sys.modules

    if __name__ == "__main__":
        import numpy

        multiprocessing.set_forkserver_preload(["colorsys"])
        with MemmappingPool(2) as pool:
            print(set(pool.map(where_am_i, range(4))))
    """
)


def test_the_fork_server_preloads_memshare_and_keeps_the_users_preload(tmp_path):
    script = tmp_path / "preload.py"
    script.write_text(PRELOAD_SCRIPT)
    result = _run([str(script)])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "{(True, True)}\n"


WORKER_SIDE_SCRIPT = textwrap.dedent(
    """
    from memshare import MemmappingPool

    def double(x):
        return 2 * x

    if __name__ == "__main__":
        with MemmappingPool(4) as pool:
            print(pool.map(double, range(8), chunksize=1))
    """
)


def test_forkserver_workers_start_with_memshares_worker_side_imported(tmp_path):
    """The fork server imports what workers run, once: no worker imports it again after its fork.

    ``python -v`` prints each import of each process: the worker side is imported by the parent (the pool
    imports it) and by the server, and by none of the four workers forked from the server.
    """
    script = tmp_path / "workers.py"
    script.write_text(WORKER_SIDE_SCRIPT)
    result = _run(["-v", str(script)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == f"{[2 * x for x in range(8)]}\n"
    imports = [line for line in result.stderr.splitlines() if line.startswith("import 'memshare._worker._run'")]
    assert len(imports) == 2, imports
