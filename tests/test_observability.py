"""Progress bars, the decision log and the call figures."""

import logging

import numpy as np
import pytest
from conftest import RETURN_AS, run_script, total

import memshare
from memshare import MemmappingPool, Parallel, delayed


@pytest.mark.parametrize("return_as", RETURN_AS)
def test_parallel_progress_bar_on_stderr_only_when_asked(return_as):
    script = f"""
        from memshare import Parallel, delayed
        def f(x):
            return x
        if __name__ == "__main__":
            out = Parallel(n_jobs=2, return_as={return_as!r}, progress=PROGRESS)(delayed(f)(i) for i in range(40))
            print(sorted(out) == list(range(40)))
    """
    shown = run_script(script.replace("PROGRESS", "True"))
    hidden = run_script(script.replace("PROGRESS", "False"))
    assert shown.stdout.strip() == hidden.stdout.strip() == "True"
    assert "40task" in shown.stderr.replace(" ", "") or "40/40" in shown.stderr
    assert "task" not in hidden.stderr


def test_pool_progress_bars():
    result = run_script(
        """
        from memshare import MemmappingPool
        def f(x):
            return 2 * x
        if __name__ == "__main__":
            with MemmappingPool(2) as pool:
                assert pool.map(f, range(30), progress=True) == [2 * i for i in range(30)]
                assert sorted(pool.imap_unordered(f, range(7), progress=True)) == [2 * i for i in range(7)]
                assert list(pool.imap(f, iter(range(5)), progress=True)) == [0, 2, 4, 6, 8]
                assert pool.map(f, range(3)) == [0, 2, 4]
        """
    )
    assert "30/30" in result.stderr and "7/7" in result.stderr and "5task" in result.stderr.replace(" ", "")


def test_decision_log_names_each_array_once_with_its_decision(shm_dir, tmp_path, caplog):
    big = np.ones(300_000)
    small = np.ones(10)
    user = np.memmap(tmp_path / "u.dat", dtype="f8", mode="w+", shape=(1000,))
    with caplog.at_level(logging.DEBUG, logger="memshare"):
        out = Parallel(n_jobs=2)(delayed(total)(big, small, user) for _ in range(6))
    assert out == [300_010.0] * 6
    lines = [r.getMessage() for r in caplog.records if r.name == "memshare"]
    dumped = [line for line in lines if line.startswith("dumped")]
    referenced = [line for line in lines if line.startswith("referenced")]
    pickled = [line for line in lines if line.startswith("pickled") and "shape=(10,)" in line]
    assert len(dumped) == 1 and "shape=(300000,)" in dumped[0] and " ms" in dumped[0]
    assert len(referenced) == 1 and "u.dat" in referenced[0]
    assert len(pickled) == 1
    assert any(line.startswith("memshare: ") and "arrays dumped" in line for line in lines)  # the summary
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == 1 and stats["bytes_dumped"] == big.nbytes
    assert stats["arrays_referenced"] == 1 and stats["bytes_referenced"] == user.nbytes
    assert stats["arrays_pickled"] >= 1
    del user


def test_stats_count_results_and_reset_for_sequential_calls(shm_dir):
    with MemmappingPool(2) as pool:
        pool.map(np.ones, [400_000, 10, 400_000])
    stats = memshare.last_call_stats()
    assert stats["results_by_reference"] == 2 and stats["bytes_results_by_reference"] == 2 * 3_200_000
    Parallel(n_jobs=1)(delayed(total)(np.ones(300_000)) for _ in range(2))
    assert memshare.last_call_stats()["tasks"] == 0 and memshare.last_call_stats()["arrays_dumped"] == 0


def test_memshare_debug_environment_variable_turns_the_log_on():
    code = """
        import numpy as np
        from memshare import Parallel, delayed
        if __name__ == "__main__":
            Parallel(n_jobs=2)(delayed(np.sum)(np.ones(300_000)) for _ in range(2))
    """
    on = run_script(code, env={"MEMSHARE_DEBUG": "1"})
    off = run_script(code, env={"MEMSHARE_DEBUG": "0"})
    assert "[memshare] held once array shape=(300000,)" in on.stderr
    assert "memshare" not in off.stderr
    plain = run_script(code, env={"MEMSHARE_DEBUG": "1", "MEMSHARE_PROMOTE": "0"})
    assert "[memshare] dumped array shape=(300000,)" in plain.stderr
