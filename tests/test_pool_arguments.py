"""MemmappingPool takes joblib's MemmappingPool arguments, in joblib's order."""

from __future__ import annotations

import logging
import multiprocessing as mp

import numpy as np
import pytest
from conftest import memshare_entries, run_script

import memshare
from memshare import MemmappingPool


class Celsius:
    def __init__(self, degrees):
        self.degrees = degrees


class Fahrenheit:
    def __init__(self, degrees):
        self.degrees = degrees


def describe(x):
    return type(x).__name__, x.degrees


def warm(degrees):
    return Celsius(degrees)


def write_first(x):
    x[0] = 5.0
    return float(x[0])


def setup(value):
    global SETUP
    SETUP = value


def read_setup(_):
    return SETUP


def test_joblib_positional_order(shm_dir, tmp_path):
    folder = tmp_path / "chosen"
    data = np.zeros(200_000)  # 1.6 MB: above 1e6 bytes
    with MemmappingPool(1, str(folder), 1e6, "c") as pool:
        assert pool.temp_folder.startswith(str(folder))
        assert pool.apply(write_first, (data,)) == 5.0  # copy-on-write: writable in the worker
        assert memshare_entries(folder)  # dumped there
    assert data[0] == 0.0
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    assert memshare_entries(folder) == [] and memshare_entries(shm_dir) == []


def test_standard_pool_arguments_are_keywords(shm_dir):
    with MemmappingPool(2, initializer=setup, initargs=(7,), maxtasksperchild=3, context="spawn") as pool:
        assert pool.map(read_setup, range(4)) == [7] * 4


@pytest.mark.parametrize(
    "args",
    [(2, setup), (2, None, (7,)), (2, None, "1M", "r", mp.get_context("spawn"))],
    ids=["initializer", "initargs", "context"],
)
def test_the_standard_pools_positional_order_is_named_in_the_error(shm_dir, args):
    with pytest.raises(TypeError, match="joblib's positional order.*as keywords"):
        MemmappingPool(*args)


def test_reducers_apply_to_arguments_and_to_results(shm_dir):
    to_fahrenheit = {Celsius: lambda c: (Fahrenheit, (c.degrees * 9 / 5 + 32,))}  # a lambda: cloudpickled
    with MemmappingPool(2, forward_reducers=to_fahrenheit) as pool:
        assert pool.apply(describe, (Celsius(100),)) == ("Fahrenheit", 212.0)
        assert type(pool.apply(warm, (0,))) is Celsius  # results unchanged
    with MemmappingPool(2, backward_reducers=to_fahrenheit) as pool:
        assert pool.apply(describe, (Celsius(100),)) == ("Celsius", 100)  # arguments unchanged
        back = pool.apply(warm, (0,))
        assert type(back) is Fahrenheit and back.degrees == 32.0


@pytest.mark.parametrize("bad", [{"not a type": str}, {Celsius: "not callable"}, [Celsius]])
def test_bad_reducers_are_rejected(shm_dir, bad):
    with pytest.raises(TypeError, match="forward_reducers.*dict mapping types"):
        MemmappingPool(1, forward_reducers=bad)


def test_verbose_logs_decisions(shm_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="memshare")
    with MemmappingPool(1, verbose=2) as pool:
        pool.apply(len, (np.ones(300_000),))
    assert any(record.message.startswith("dumped array") for record in caplog.records)


def test_prewarm_and_context_id_are_accepted(shm_dir):
    for prewarm in (True, False, "auto"):
        with MemmappingPool(1, prewarm=prewarm) as pool:
            assert pool.apply(len, (np.ones(300_000),)) == 300_000
    with pytest.raises(TypeError, match="prewarm"):
        MemmappingPool(1, prewarm="yes")
    with pytest.warns(DeprecationWarning, match="context_id"):
        MemmappingPool(1, context_id="abc").terminate()


@pytest.mark.parametrize("verbose", [-1, "loud", 1.5])
def test_bad_verbose_is_rejected(shm_dir, verbose):
    with pytest.raises(TypeError, match="verbose"):
        MemmappingPool(1, verbose=verbose)


def test_initializer_and_reducers_defined_in_main_work_under_the_default_start_method(shm_dir):
    # Functions of __main__ cannot be imported by forkserver or spawn workers;
    # memshare sends them by value.
    result = run_script(
        """
        import os

        import memshare

        class Box:
            def __init__(self, value):
                self.value = value

        def setup(value):
            os.environ["SETUP"] = value  # tasks of __main__ travel by value: they share no globals with it

        def read(box):
            return os.environ["SETUP"], type(box).__name__, box.value

        if __name__ == "__main__":
            with memshare.MemmappingPool(2, initializer=setup, initargs=("7",),
                                         forward_reducers={Box: lambda b: (Box, (b.value + 1,))}) as pool:
                print(pool.map(read, [Box(1), Box(2)]))
        """
    )
    assert result.stdout.strip() == "[('7', 'Box', 2), ('7', 'Box', 3)]"
