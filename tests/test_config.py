import numpy as np
import pytest

import memshare
from memshare._config import Settings, check_mmap_mode, parse_max_nbytes


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
    ],
)
def test_max_nbytes_accepts_sizes(value, expected):
    assert parse_max_nbytes(value) == expected


@pytest.mark.parametrize("value", ["lots", "-1", -1, "1X", 1.5, True, [1]])
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
