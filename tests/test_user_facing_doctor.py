"""A temp folder on disk is said so, and ``doctor`` reports the configuration that is really in force.

A folder the user chose (``temp_folder=``, ``MEMSHARE_TEMP_FOLDER``,
``JOBLIB_TEMP_FOLDER``) on a disk file system costs writes to the disk and a
second copy in the page cache: memshare warns once per process and folder,
logs creating a missing one, and ``doctor`` notes it. ``doctor`` never says a
feature is on when the settings in force turn it off, and says why.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
import warnings

import joblib
import numpy as np
import pytest
from conftest import array_fit_to_hold

import memshare
from memshare import _config
from memshare._lifetime import _location, _procfs
from memshare._parent import _held_once
from memshare._parent._held_memory import unsupported_reason
from memshare._tools import doctor as _doctor

# Version-independent (doctor's report, whose checks of other libraries test_compat runs everywhere): run in CI's
# whole-suite environment (main) only.
pytestmark = pytest.mark.version_independent

BIG = 300_000  # float64: 2.4 MB, above the default max_nbytes of 1 MiB


@pytest.fixture
def clean_environment(default_location):
    """No temp folder or promote setting from the environment that runs the tests."""


def _doctor_lines(**kwargs) -> list:
    lines: list = []
    _doctor.run_doctor(say=lines.append, **kwargs)
    return lines


def _line(lines: list, start: str) -> str:
    found = [line for line in lines if line.strip().startswith(start)]
    assert len(found) == 1, lines
    return found[0]


def _disk_fstype(path) -> str:
    fstype = _location.mount_fstype(os.path.realpath(str(path)), _procfs.mountinfo())
    if fstype in (None, "tmpfs", "ramfs"):
        pytest.skip(f"{path} is not on a disk file system here ({fstype})")
    return fstype


def chunk_sum(X):
    return float(X.sum())


# -- 2. a temp folder on disk ----------------------------------------------------------------------------------


def test_disk_folder_message_names_the_cost_and_the_fix():
    """Only a disk file system gets the message; it names the cost and how to choose RAM instead."""
    message = _config.disk_folder_message("/data/tmp", "ext4", "the temp_folder argument")
    assert message is not None
    assert "ext4" in message and "/data/tmp" in message and "page cache" in message
    assert "leave temp_folder unset" in message and "/dev/shm" in message
    for ram in ("tmpfs", "ramfs", None):
        assert _config.disk_folder_message("/dev/shm/x", ram, "the temp_folder argument") is None


def test_disk_temp_folder_warns_once_and_logs_its_creation(tmp_path, clean_environment, caplog):
    """temp_folder on ext4 that does not exist: created (logged), one warning for two calls."""
    fstype = _disk_fstype(tmp_path)
    folder = tmp_path / "not" / "there"
    X = np.ones(BIG)
    with caplog.at_level(logging.INFO, logger="memshare"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert (
                memshare.Parallel(n_jobs=2, temp_folder=str(folder))(memshare.delayed(chunk_sum)(X) for _ in range(2))
                == [float(BIG)] * 2
            )
    mine = [w for w in caught if "not RAM" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert issubclass(mine[0].category, memshare.SharedMemoryFallbackWarning)
    assert fstype in str(mine[0].message) and str(folder) in str(mine[0].message)
    assert any("created" in record.getMessage() and str(folder) in record.getMessage() for record in caplog.records)


def test_ram_temp_folder_does_not_warn(clean_environment):
    """A folder the user chose in /dev/shm (tmpfs) is RAM: no warning."""
    if _location.mount_fstype("/dev/shm", _procfs.mountinfo()) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    folder = f"/dev/shm/user-facing-test-{uuid.uuid4().hex}"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            memshare.Parallel(n_jobs=2, temp_folder=folder)(memshare.delayed(chunk_sum)(np.ones(BIG)) for _ in range(2))
        assert not [w for w in caught if "not RAM" in str(w.message)], [str(w.message) for w in caught]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_doctor_notes_a_disk_temp_folder(tmp_path, clean_environment, monkeypatch):
    """doctor with MEMSHARE_TEMP_FOLDER on a disk: a NOTE with the cost and the fix, still OK."""
    fstype = _disk_fstype(tmp_path)
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(tmp_path))
    lines = _doctor_lines()
    notes = [line for line in lines if line.startswith("NOTE:") and "not RAM" in line]
    assert len(notes) == 1 and fstype in notes[0] and "MEMSHARE_TEMP_FOLDER" in notes[0], lines


# -- 3. doctor tells the configuration in force ----------------------------------------------------------------


def test_doctor_held_once_on_by_default(clean_environment):
    if unsupported_reason():
        pytest.skip("arrays held once are not supported here")
    assert _line(_doctor_lines(), "arrays held once:").strip() == "arrays held once: on"


def test_doctor_held_once_off_with_a_temp_folder(tmp_path, clean_environment, monkeypatch):
    """A temp folder turns holding once off: doctor says off, and why."""
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(tmp_path))
    line = _line(_doctor_lines(), "arrays held once:")
    assert "arrays held once: off" in line and "MEMSHARE_TEMP_FOLDER" in line, line


def test_doctor_held_once_off_with_promote_zero(clean_environment, monkeypatch):
    monkeypatch.setenv("MEMSHARE_PROMOTE", "0")
    line = _line(_doctor_lines(), "arrays held once:")
    assert "off" in line and "MEMSHARE_PROMOTE=0" in line, line


def test_doctor_reads_parallel_config(tmp_path, clean_environment):
    """Inside joblib.parallel_config(backend="memshare", ...), doctor reports those settings and their effect."""
    with joblib.parallel_config(backend="memshare", temp_folder=str(tmp_path), mmap_mode="r+", max_nbytes="2M"):
        lines = _doctor_lines()
    assert str(tmp_path) in _line(lines, "temp_folder:") and "parallel_config" in _line(lines, "temp_folder:")
    assert "'r+'" in _line(lines, "mmap_mode:") and "parallel_config" in _line(lines, "mmap_mode:")
    assert "2.0 MiB" in _line(lines, "max_nbytes:")
    held = _line(lines, "arrays held once:")
    assert "off" in held and "mmap_mode='r+'" in held, held
    assert any(line.strip().startswith(f"named files in {tmp_path}") for line in lines), lines


def test_doctor_defaults_say_where_they_come_from(clean_environment):
    lines = _doctor_lines()
    assert "default" in _line(lines, "temp_folder:") and "default" in _line(lines, "mmap_mode:")
    assert "1.0 MiB" in _line(lines, "max_nbytes:")


@pytest.mark.parametrize(
    "environment, options",
    [
        ({}, {}),
        ({"MEMSHARE_TEMP_FOLDER": "TMP"}, {}),
        ({"MEMSHARE_TEMP_FOLDER": "/dev/shm"}, {}),
        ({}, {"temp_folder": "/dev/shm"}),
        ({}, {"mmap_mode": "r+"}),
        ({}, {"mmap_mode": "c"}),
        ({"MEMSHARE_PROMOTE": "0"}, {}),
    ],
)
def test_doctor_agrees_with_what_a_call_does(tmp_path, clean_environment, monkeypatch, environment, options):
    """doctor's 'arrays held once' is what _held_once decides for a large ordinary array in the same settings."""
    # Fit to hold with the defaults (where the machine can hold any); the settings under test decide below.
    array = array_fit_to_hold(64 * 1024**2) if unsupported_reason() is None else np.ones(64 * 1024**2 // 8)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, str(tmp_path) if value == "TMP" else value)
    settings = _config.Settings.from_user(**options)
    with joblib.parallel_config(backend="memshare", **options):
        line = _line(_doctor_lines(), "arrays held once:")
    held = settings.promote and _held_once.unfit_reason(array, settings.mmap_mode, settings.temp_folder) is None
    assert line.strip().startswith("arrays held once: on" if held else "arrays held once: off"), (line, settings)


def test_doctor_reads_promote_from_parallel_config(clean_environment):
    """parallel_config(backend="memshare", promote=False) turns holding once off for its calls: doctor says so."""
    with joblib.parallel_config(backend="memshare", promote=False):
        line = _line(_doctor_lines(), "arrays held once:")
    assert "off" in line and "promote=False" in line and "parallel_config" in line, line
