"""The doctor's report of the sharing settings in force, as a call made here would see them, and where each comes from.

An enclosing ``joblib.parallel_config`` wins over the environment, which wins
over the defaults. A feature the settings turn off is reported off, with
why: never "on" for what a call would not do.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from .. import _compat
from .._config import (
    ENV_PROMOTE,
    Settings,
    check_mmap_mode,
    check_promote,
    check_temp_folder,
    disk_folder_message,
    folder_from_environment,
    format_bytes,
    parse_max_nbytes,
)
from .._lifetime import _procfs
from .._lifetime._location import SHM_ROOT, Location, mount_fstype
from .._parent._held_memory import malloc_in_use, unsupported_reason
from .._payload._routes import mode_unfit_reason

_CONFIG = "joblib.parallel_config"


@dataclass
class InForce:
    """The sharing settings a ``memshare.Parallel`` call made here would use, and where each comes from.

    An option of the innermost ``joblib.parallel_config`` (when it chooses
    memshare's backend, or no backend) wins over the environment, which wins
    over the defaults, as in a call. ``temp_folder`` is the argument-level
    folder (from ``parallel_config``); a folder from the environment shows in
    the location instead, as in a call.
    """

    settings: Settings
    sources: Dict[str, str]
    other_backend: Optional[str] = None  # parallel_config chooses a backend that is not memshare's
    problems: List[str] = field(default_factory=list)


def settings_in_force() -> InForce:
    """The settings of a call made here, read from ``parallel_config``, the environment and the defaults."""
    options = _compat.parallel_config_options()
    backend = options.get("backend")
    name = backend if isinstance(backend, str) else type(backend).__name__
    other = None
    if backend is not None and name not in ("memshare", "MemshareBackend"):
        other, options = str(name), {}
    defaults = Settings()
    sources = {key: "default" for key in ("max_nbytes", "mmap_mode", "temp_folder", "promote")}
    values: Dict[str, object] = {
        "max_nbytes": defaults.max_nbytes,
        "mmap_mode": defaults.mmap_mode,
        "temp_folder": None,
    }
    problems: List[str] = []
    checks = {"max_nbytes": parse_max_nbytes, "mmap_mode": check_mmap_mode, "temp_folder": check_temp_folder}
    for key, check in checks.items():
        if key in options:
            try:
                values[key] = check(options[key])  # type: ignore[operator]
                sources[key] = _CONFIG
            except (TypeError, ValueError) as exc:
                problems.append(f"{_CONFIG}({key}=...) is refused by memshare: {exc}")
    if values["temp_folder"] is None:
        from_environment = folder_from_environment()
        if from_environment is not None:
            sources["temp_folder"] = f"${from_environment[1]}"
    configured = getattr(backend, "promote", None) if other is None else None
    try:
        promote = check_promote(configured if isinstance(configured, bool) else None)
        if isinstance(configured, bool):
            sources["promote"] = f"{_CONFIG}'s memshare backend, promote={configured}"
        elif os.environ.get(ENV_PROMOTE, "").strip():
            sources["promote"] = f"${ENV_PROMOTE}"
    except ValueError as exc:
        problems.append(str(exc))
        promote = False
    settings = Settings(values["max_nbytes"], values["mmap_mode"], values["temp_folder"], promote)  # type: ignore[arg-type]
    return InForce(settings, sources, other, problems)


def held_once_reason(settings: Settings, location: Location, promote_source: str = "promote=False") -> Optional[str]:
    """Why large ordinary arrays are not held once under ``settings``; None when they are.

    The settings' part of ``_held_once.unfit_reason`` (the rest is about
    each array: its allocator, layout and size); a test keeps the two in step.
    """
    unsupported = unsupported_reason()
    if unsupported:
        return f"unavailable here: {unsupported}"
    if not settings.promote:
        return f"{promote_source} turns it off"
    mode_reason = mode_unfit_reason(settings.mmap_mode)
    if mode_reason is not None:
        return mode_reason
    if not location.in_memory and (location.base != SHM_ROOT or settings.temp_folder is not None):
        return (
            f"a temp folder is set ({location.chosen_by or location.reason}): arrays are held once only where "
            "memshare chooses the location (memfds or /dev/shm); they are dumped instead"
        )
    return None


def report_settings(
    in_force: InForce, location: Location, say: Callable[[str], None], problems: List[str], notes: List[str]
) -> None:
    """One line per setting, with where it comes from, and whether arrays are held once (and why not)."""
    settings, sources = in_force.settings, in_force.sources
    if in_force.other_backend is not None:
        say(
            f"  {_CONFIG} chooses the backend {in_force.other_backend!r}: joblib.Parallel does not use memshare "
            "there (memshare.Parallel and MemmappingPool do); the settings below are memshare's"
        )
    folder = settings.temp_folder
    if folder is None and location.chosen_by is not None:
        folder = location.base
    where = "unset: memshare chooses (memfds, else /dev/shm)" if folder is None else folder
    say(f"  temp_folder: {where} ({sources['temp_folder']})")
    limit = (
        "None (dumping off: arrays are pickled)" if settings.max_nbytes is None else format_bytes(settings.max_nbytes)
    )
    say(f"  max_nbytes: {limit} ({sources['max_nbytes']})")
    say(f"  mmap_mode: {settings.mmap_mode!r} ({sources['mmap_mode']})")
    source = sources["promote"]
    promote_source = f"{ENV_PROMOTE}={os.environ.get(ENV_PROMOTE, '').strip()}" if source.startswith("$") else source
    reason = held_once_reason(settings, location, promote_source)
    say("  arrays held once: on" if reason is None else f"  arrays held once: off ({reason})")
    if sys.platform.startswith("linux"):
        say(f"  malloc: {malloc_in_use().describe()}")  # holding once needs glibc's
    problems.extend(in_force.problems)
    fstype = mount_fstype(os.path.realpath(location.base), _procfs.mountinfo())
    note = disk_folder_message(location.base, fstype, location.chosen_by) if location.chosen_by else None
    if note is not None:
        notes.append(note[len("memshare: ") :])
