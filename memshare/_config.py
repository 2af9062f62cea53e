"""Validation of the user-facing sharing settings.

Every entry point (``MemmappingPool``, the joblib backend, the shared-array
constructors) funnels its ``max_nbytes``, ``mmap_mode`` and ``temp_folder``
through this module, so that a bad value gives the same clear error wherever
it is passed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Union

#: Modes a worker may map an automatically dumped array with.
MMAP_MODES = ("r", "r+", "w+", "c")

_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)

#: Environment variable overriding where the temp folders go.
ENV_TEMP_FOLDER = "MEMSHARE_TEMP_FOLDER"
#: joblib's variable, honoured when memshare's own is not set.
ENV_JOBLIB_TEMP_FOLDER = "JOBLIB_TEMP_FOLDER"


def parse_max_nbytes(value: Union[int, str, None]) -> Optional[int]:
    """Return ``value`` as a number of bytes, or None when dumping is disabled.

    Accepts a non-negative int, a string such as ``"1M"``, ``"10K"``, ``"2G"``
    (binary units, an optional trailing ``B``/``iB``), or None.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(_max_nbytes_help(value))
    if isinstance(value, int) or (hasattr(value, "__index__") and not isinstance(value, str)):
        number = int(value)
        if number < 0:
            raise ValueError(_max_nbytes_help(value))
        return number
    if isinstance(value, str):
        match = _SIZE_PATTERN.match(value)
        if match is None:
            raise ValueError(_max_nbytes_help(value))
        number, unit = match.groups()
        return int(float(number) * _UNITS[unit.upper()])
    raise TypeError(_max_nbytes_help(value))


def _max_nbytes_help(value: object) -> str:
    return (
        f"max_nbytes={value!r} is not a valid size. Pass a non-negative number of bytes "
        "(e.g. 1048576), a string such as '10K', '1M' or '2G', or None to disable "
        "dumping arrays to shared memory."
    )


def check_mmap_mode(value: object) -> str:
    """Return ``value`` if it is a mode workers can map dumped arrays with."""
    if value not in MMAP_MODES:
        raise ValueError(
            f"mmap_mode={value!r} is not supported. Use one of {', '.join(map(repr, MMAP_MODES))}: "
            "'r' read-only, 'c' copy-on-write (writes stay private to the worker), "
            "'r+' or 'w+' shared and writable. To stop dumping arrays, pass max_nbytes=None "
            "instead."
        )
    return value  # type: ignore[return-value]


def check_temp_folder(value: object) -> Optional[str]:
    """Return ``value`` as an absolute path string, or None."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"temp_folder={value!r} must be a path (str or os.PathLike) or None for the default.")
    return os.path.abspath(os.fspath(value))


@dataclass(frozen=True)
class Settings:
    """The sharing settings of one pool or one joblib call.

    ``max_nbytes`` is None when dumping is disabled; ``temp_folder`` is None
    when memshare chooses the location itself.
    """

    max_nbytes: Optional[int] = 1024**2
    mmap_mode: str = "r"
    temp_folder: Optional[str] = None

    @classmethod
    def from_user(
        cls,
        max_nbytes: Union[int, str, None] = "1M",
        mmap_mode: str = "r",
        temp_folder: Optional[str] = None,
    ) -> Settings:
        """Validate user arguments; raise a clear error for any bad one."""
        return cls(
            max_nbytes=parse_max_nbytes(max_nbytes),
            mmap_mode=check_mmap_mode(mmap_mode),
            temp_folder=check_temp_folder(temp_folder),
        )
