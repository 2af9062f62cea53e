import logging
import os
import re
import tempfile

import numpy as np
import pytest
from conftest import run_script
from joblib.disk import memstr_to_bytes

import memshare
from memshare import delayed
from memshare._config import Settings, check_mmap_mode, env_flag, parse_max_nbytes
from memshare._lifetime import _memfd
from memshare._lifetime._location import SHM_ROOT, default_base
from memshare._parent._session import Session


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        (0, 0),
        (1024, 1024),
        ("1M", 1024**2),
        ("10K", 10240),
        ("2G", 2 * 1024**3),
        ("1.5k", 1536),
        ("3MB", 3 * 1024**2),
        ("12", 12),
        (np.int64(5), 5),
        (1.5, 1),  # a float threshold, as joblib takes one: sizes are whole bytes, so > 1.5 is > 1
        (1e6, 1_000_000),  # joblib's MemmappingPool default is this float
    ],
)
def test_max_nbytes_accepts_sizes(value, expected):
    assert parse_max_nbytes(value) == expected


@pytest.mark.parametrize("value", ["lots", "-1", -1, "1X", -1.5, True, [1]])
def test_max_nbytes_rejects_bad_values_with_a_clear_message(value):
    with pytest.raises((ValueError, TypeError), match="max_nbytes"):
        parse_max_nbytes(value)


@pytest.mark.parametrize("mode", ["r", "r+", "w+", "c"])
def test_valid_mmap_modes(mode):
    assert check_mmap_mode(mode) == mode


@pytest.mark.parametrize("mode", [None, "w", "rw", "readonly", 1])
def test_unknown_mmap_mode_lists_the_valid_ones(mode):
    with pytest.raises(ValueError, match="'r', 'r\\+', 'w\\+', 'c'"):
        check_mmap_mode(mode)


def test_settings_from_user_validates_everything():
    settings = Settings.from_user("2K", "c", "relative/folder")
    assert settings.max_nbytes == 2048 and settings.mmap_mode == "c"
    assert settings.temp_folder.endswith("relative/folder") and settings.temp_folder.startswith("/")
    with pytest.raises(TypeError, match="temp_folder"):
        Settings.from_user(temp_folder=3)


@pytest.mark.parametrize("processes", [0, -1, 1.5, "2"])
def test_pool_rejects_bad_process_counts(processes):
    with pytest.raises(ValueError, match="processes"):
        memshare.MemmappingPool(processes)


def test_pool_rejects_bad_settings_before_starting_workers():
    with pytest.raises(ValueError, match="mmap_mode"):
        memshare.MemmappingPool(1, mmap_mode=None)
    with pytest.raises(ValueError, match="max_nbytes"):
        memshare.MemmappingPool(1, max_nbytes="huge")


JOBLIB_SIZES = ["10K", "500M", "2G", "1.5K", " 2K", "2 K", "1e3K", "1_000K", "0K"]


@pytest.mark.parametrize("value", JOBLIB_SIZES)
def test_every_size_joblib_reads_is_read_the_same(value):
    assert parse_max_nbytes(value) == memstr_to_bytes(value)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("10 KiB", 10240),
        ("1 GB", 1024**3),
        ("0", 0),
        ("4096", 4096),
        ("2t", 2 * 1024**4),
        ("3 mb", 3 * 1024**2),
        (1e6, 10**6),
    ],
)
def test_parallel_takes_the_sizes_the_pool_takes(value, expected):
    assert parse_max_nbytes(value) == expected
    # memshare.Parallel parses before joblib, whose own parser would reject most of these.
    parallel = memshare.Parallel(n_jobs=2, max_nbytes=value)
    # What joblib passes on to the backend (joblib 1.3 and 1.4 name it _backend_args).
    passed_on = getattr(parallel, "_backend_kwargs", None) or parallel._backend_args
    assert passed_on["max_nbytes"] == expected


@pytest.mark.parametrize("value", ["-1K", "1X", "nanK", "infK", "ten", "", "K", -1, float("nan")])
def test_parallel_and_pool_reject_the_same_sizes_with_the_same_message(value):
    with pytest.raises(ValueError, match="max_nbytes") as from_parser:
        parse_max_nbytes(value)
    message = re.escape(str(from_parser.value))
    with pytest.raises(ValueError, match=message):
        memshare.Parallel(n_jobs=2, max_nbytes=value)
    with pytest.raises(ValueError, match=message):
        memshare.Parallel(2, None, "list", 0, None, "2*n_jobs", "auto", None, value)  # max_nbytes by position
    with pytest.raises(ValueError, match=message):
        memshare.MemmappingPool(1, max_nbytes=value)


def sizes_of(*arrays):
    return [a.nbytes for a in arrays]


def test_a_size_joblib_cannot_read_works_in_a_parallel_call(shm_dir):
    small, large = np.ones(1000), np.ones(2000)  # 8000 and 16000 bytes
    assert (
        memshare.Parallel(n_jobs=2, max_nbytes="10 KiB")(delayed(sizes_of)(small, large) for _ in range(2))
        == [[8000, 16000]] * 2
    )
    assert memshare.last_call_stats()["arrays_dumped"] == 1  # only the array above 10 KiB


def test_empty_temp_folder_means_the_default_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", "")
    monkeypatch.setenv("JOBLIB_TEMP_FOLDER", str(tmp_path / "from-joblib"))
    assert Settings.from_user(temp_folder="").temp_folder is None
    assert default_base(None)[0] == str(tmp_path / "from-joblib")  # empty MEMSHARE_TEMP_FOLDER is unset
    monkeypatch.setenv("JOBLIB_TEMP_FOLDER", "")
    assert default_base(Settings.from_user(temp_folder="").temp_folder)[0] in (SHM_ROOT, tempfile.gettempdir())
    data = np.ones(200_000)
    assert memshare.Parallel(n_jobs=2, temp_folder="")(delayed(len)(data) for _ in range(2)) == [200_000] * 2
    # Shared, and not under the current folder. Dumped or held once, as glibc served the array: from a mapping
    # of its own in a fresh process, from the heap once earlier frees raised glibc's mmap threshold.
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] + stats["arrays_held_once"] == 1 and os.listdir(tmp_path) == []


@pytest.mark.parametrize("variable", [None, "MEMSHARE_TEMP_FOLDER", "JOBLIB_TEMP_FOLDER"])
def test_tilde_is_expanded_in_the_argument_and_both_variables(tmp_path, monkeypatch, variable):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEMSHARE_TEMP_FOLDER", raising=False)
    monkeypatch.delenv("JOBLIB_TEMP_FOLDER", raising=False)
    if variable is None:
        settings = Settings.from_user(max_nbytes=0, temp_folder="~/shared")
    else:
        monkeypatch.setenv(variable, "~/shared")
        settings = Settings.from_user(max_nbytes=0)
    session = Session(settings)
    data = np.ones(1000)
    try:
        session.pack_task(len, (data,))
        assert len(os.listdir(session.folder.pair.primary)) == 1  # the dump is there
        assert session.folder.pair.primary.startswith(str(home / "shared") + os.sep)
    finally:
        session.close()
    assert not (tmp_path / "~").exists()


FLAGS = ["MEMSHARE_MEMFD", "MEMSHARE_PROMOTE", "MEMSHARE_DEBUG"]


@pytest.mark.parametrize("value, expected", [(" 1 ", True), ("TRUE", True), ("yes", True), ("On", True)])
@pytest.mark.parametrize("variable", FLAGS)
def test_every_yes_no_variable_takes_the_same_words(monkeypatch, variable, value, expected):
    for default in (True, False):
        monkeypatch.setenv(variable, value)
        assert env_flag(variable, default) is expected
        monkeypatch.setenv(variable, {" 1 ": "0", "TRUE": "false", "yes": "No", "On": " OFF"}[value])
        assert env_flag(variable, default) is not expected
        monkeypatch.setenv(variable, "")
        assert env_flag(variable, default) is default
        monkeypatch.delenv(variable)
        assert env_flag(variable, default) is default


@pytest.mark.parametrize("value", ["2", "maybe", "-1", "y"])
@pytest.mark.parametrize("variable", FLAGS)
def test_a_yes_no_variable_refuses_any_other_word(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}='{re.escape(value)}' is not understood: set it to 1"):
        env_flag(variable, True)


def test_memshare_memfd_and_debug_read_that_grammar(monkeypatch):
    """MEMSHARE_MEMFD took any word but 0, no, false, off as yes; MEMSHARE_DEBUG any word but 0 (even "false")."""
    monkeypatch.setenv("MEMSHARE_MEMFD", "maybe")
    with pytest.raises(ValueError, match="MEMSHARE_MEMFD='maybe'"):
        _memfd._probe()
    monkeypatch.setenv("MEMSHARE_MEMFD", "Off")
    assert _memfd._probe() == (False, "MEMSHARE_MEMFD=off turns memfds off")
    for value, logs in [("false", False), ("yes", True)]:
        code = "import logging, memshare; print(logging.getLogger('memshare').level)"
        out = run_script(code, env={"MEMSHARE_DEBUG": value}).stdout.strip()
        assert (out == str(logging.DEBUG)) is logs, (value, out)
    failed = run_script("import memshare", env={"MEMSHARE_DEBUG": "2"}, check=False)
    assert failed.returncode != 0 and "MEMSHARE_DEBUG='2' is not understood" in failed.stderr
