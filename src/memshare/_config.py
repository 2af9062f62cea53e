"""Validation of the user-facing sharing settings, and the byte sizes they speak in.

Every entry point (``MemmappingPool``, the joblib backend, the shared-array
constructors) funnels its ``max_nbytes``, ``mmap_mode`` and ``temp_folder``
through this module, so that a bad value gives the same clear error wherever
it is passed.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Optional, Tuple, Union

#: Modes a worker may map an automatically dumped array with.
MMAP_MODES = ("r", "r+", "w+", "c")

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
# A number as float() reads it (joblib's parser uses float() too: "1.5K",
# "1e3K", "1_000K"), then an optional binary unit with an optional B or iB.
_SIZE_PATTERN = re.compile(r"^\s*(?P<number>.*?)\s*(?P<unit>[KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)

#: Environment variable overriding where the temp folders go.
ENV_TEMP_FOLDER = "MEMSHARE_TEMP_FOLDER"
#: joblib's variable, honoured when memshare's own is not set.
ENV_JOBLIB_TEMP_FOLDER = "JOBLIB_TEMP_FOLDER"
#: Environment variable turning arrays held once off ("0") or on ("1", the default).
ENV_PROMOTE = "MEMSHARE_PROMOTE"
#: Environment variable turning the decision log on ("1") or off ("0", the default).
ENV_DEBUG = "MEMSHARE_DEBUG"
#: The words of a yes/no environment variable (``env_flag``), any case.
_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def env_flag(variable: str, default: bool) -> bool:
    """The yes/no environment variable ``variable``: ``default`` when it is unset or empty.

    The one grammar of ``MEMSHARE_MEMFD``, ``MEMSHARE_PROMOTE`` and
    ``MEMSHARE_DEBUG``: ``1``, ``true``, ``yes``, ``on`` or ``0``,
    ``false``, ``no``, ``off``, in any case, spaces around allowed (every
    word one of them took). Anything else is a ValueError naming the
    variable and the words, rather than a guess.
    """
    text = os.environ.get(variable, "").strip().lower()
    if not text:
        return default
    if text in _YES:
        return True
    if text in _NO:
        return False
    raise ValueError(
        f"{variable}={os.environ[variable]!r} is not understood: set it to 1 (or true, yes, on) or 0 "
        "(or false, no, off), or leave it empty for the default"
    )


def parse_max_nbytes(value: Union[int, float, str, None]) -> Optional[int]:
    """Return ``value`` as a number of bytes, or None when dumping is disabled.

    The one grammar of every entry point (``MemmappingPool``,
    ``memshare.Parallel``, the backend): None; a non-negative int or float
    number of bytes (a fraction is dropped: sizes are whole bytes, so the
    threshold is the same); or a string: a non-negative number, optionally
    followed by a unit ``K``, ``M``, ``G`` or ``T`` (binary: 1K = 1024 bytes,
    any case) and an optional ``B`` or ``iB``, spaces allowed around the
    parts: ``"1M"``, ``"500K"``, ``"1.5G"``, ``"10 KiB"``, ``"1 GB"``,
    ``"4096"``, ``"0"``. Every string joblib's ``memstr_to_bytes`` accepts
    that is not negative reads the same here.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(_max_nbytes_help(value))
    if isinstance(value, str):
        match = _SIZE_PATTERN.match(value)
        number = _finite_number(match.group("number")) if match else None
        if number is not None:
            number = _finite_number(number * _UNITS[match.group("unit").upper()])
        if number is None or number < 0:
            raise ValueError(_max_nbytes_help(value))
        return int(number)
    if isinstance(value, numbers.Integral):
        number = int(value)
    elif isinstance(value, numbers.Real):
        number = _finite_number(value)
        if number is None:
            raise ValueError(_max_nbytes_help(value))
    else:
        raise TypeError(_max_nbytes_help(value))
    if number < 0:
        raise ValueError(_max_nbytes_help(value))
    return int(number)


def over_max_nbytes(nbytes: int, max_nbytes: Optional[int]) -> bool:
    """True when data of ``nbytes`` bytes leaves the task payloads: more than ``max_nbytes`` (never when None).

    joblib's rule (``a.nbytes > max_nbytes`` in its memmapping reducer),
    the one rule for arrays, out-of-band buffers and argument objects, both
    ways: data of exactly ``max_nbytes`` bytes is pickled.
    """
    return max_nbytes is not None and nbytes > max_nbytes


def _finite_number(text: object) -> Optional[float]:
    """``text`` as a finite float, or None when it is not one."""
    try:
        number = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _max_nbytes_help(value: object) -> str:
    return (
        f"max_nbytes={value!r} is not a valid size. Pass a non-negative number of bytes "
        "(e.g. 1048576), a string such as '500K', '1M', '1.5G' or '10 KiB' (binary units K, M, G, T "
        "with an optional B or iB), or None to disable dumping arrays to shared memory."
    )


def format_bytes(nbytes: Optional[float]) -> str:
    """``nbytes`` in binary units for messages, e.g. ``64.0 MiB``; ``unknown`` for None."""
    if nbytes is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


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


def check_temp_folder(value: object, hint: str = "") -> Optional[str]:
    """Return ``value`` as an absolute path string, or None for memshare's default.

    An empty path counts as unset (it would otherwise mean the current
    directory) and ``~`` is expanded, as for the environment variables.
    A callable (joblib's folder resolver, or the standard pool's
    initializer passed in its place: ``hint`` then says how to pass it) is
    refused with a message of its own.
    """
    if value is None:
        return None
    if callable(value):
        raise TypeError(
            f"temp_folder={value!r} is a callable, not a folder. {hint}"
            "A folder resolver function is not supported: pass a path."
        )
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"temp_folder={value!r} must be a path (str or os.PathLike) or None for the default.")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"temp_folder={value!r} must be a str path (not bytes) or None for the default.")
    return resolve_folder(path)


def resolve_folder(path: Optional[str]) -> Optional[str]:
    """``path`` with ``~`` expanded, made absolute; None when it is None or empty."""
    if not path:
        return None
    return os.path.abspath(os.path.expanduser(path))


def folder_from_environment() -> Optional[Tuple[str, str]]:
    """The folder the environment asks for, and the variable that did; None if neither is set.

    ``MEMSHARE_TEMP_FOLDER`` first, then joblib's ``JOBLIB_TEMP_FOLDER``;
    an empty variable counts as unset.
    """
    for variable in (ENV_TEMP_FOLDER, ENV_JOBLIB_TEMP_FOLDER):
        path = resolve_folder(os.environ.get(variable))
        if path is not None:
            return path, variable
    return None


#: File system types that keep their files in RAM: a temp folder anywhere else is on a disk.
RAM_FSTYPES = frozenset({"tmpfs", "ramfs"})


def disk_folder_message(folder: str, fstype: Optional[str], why: str) -> Optional[str]:
    """What a temp folder the user chose costs when it is on a disk file system; None when it is in RAM.

    ``fstype`` is the type of the file system holding ``folder`` (None when
    unknown: no message, rather than a wrong one); ``why`` names the setting
    that chose it (``the temp_folder argument``, ``the MEMSHARE_TEMP_FOLDER
    environment variable``...). The warning of a call and doctor's note say
    the same.
    """
    if fstype is None or fstype in RAM_FSTYPES:
        return None
    return (
        f"memshare: the temp folder {folder} (chosen by {why}) is on {fstype}, not RAM: every array memshare "
        "shares is written to the disk, which is slower, and the page cache holds its data as well while "
        "workers read it. To share through RAM, leave temp_folder unset (and MEMSHARE_TEMP_FOLDER and "
        "JOBLIB_TEMP_FOLDER unset): memshare then uses memfds or /dev/shm; or point it at a folder in /dev/shm."
    )


def check_promote(value: object) -> bool:
    """The ``promote`` setting: the argument when given, else ``$MEMSHARE_PROMOTE``, else True."""
    if value is None:
        return env_flag(ENV_PROMOTE, True)
    if not isinstance(value, bool):
        raise TypeError(f"promote must be True, False or None (from ${ENV_PROMOTE}), got {value!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """The sharing settings of one pool or one joblib call.

    ``max_nbytes`` is None when dumping is disabled; ``temp_folder`` is None
    when memshare chooses the location itself.
    """

    max_nbytes: Optional[int] = 1024**2
    mmap_mode: str = "r"
    temp_folder: Optional[str] = None
    promote: bool = True  # hold large ordinary arrays once (see _held_once)

    @classmethod
    def from_user(
        cls,
        max_nbytes: Union[int, float, str, None] = "1M",
        mmap_mode: str = "r",
        temp_folder: Optional[str] = None,
        promote: Optional[bool] = None,
    ) -> Settings:
        """Validate user arguments; raise a clear error for any bad one."""
        return cls(
            max_nbytes=parse_max_nbytes(max_nbytes),
            mmap_mode=check_mmap_mode(mmap_mode),
            temp_folder=check_temp_folder(temp_folder),
            promote=check_promote(promote),
        )
