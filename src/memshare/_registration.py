"""The joblib backend registered once both memshare and joblib are imported, whichever comes first.

``import memshare`` registers the ``"memshare"`` backend, but does not import
joblib to do so: joblib and loky cost a ``MemmappingPool`` more than the rest
of memshare, and neither the pool nor its workers need them. Every way of
naming the backend (``joblib.parallel_config(backend="memshare")``,
``joblib.Parallel(backend="memshare")``, ``joblib.parallel.BACKENDS``) goes
through ``import joblib`` first. So when joblib is imported already, the
backend is registered at once; otherwise a finder on ``sys.meta_path`` waits
for joblib's package to be loaded and registers it right after joblib's
``__init__`` has run, before the ``import joblib`` that loaded it returns.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional, Sequence

from . import _forksafe


def _register() -> None:
    backend = sys.modules.get(f"{__package__}.backend")
    if backend is not None and not hasattr(backend, "register_backend"):
        # joblib was imported by memshare.backend itself, which is only half made: it registers at its end.
        return
    try:
        from .backend import register_backend

        register_backend()
    except Exception as exc:  # a joblib memshare cannot work with: say so, but never fail the user's import
        warnings.warn(f"memshare could not register its joblib backend: {exc!r}", RuntimeWarning, stacklevel=2)


class _RegisteringLoader:
    """joblib's own loader, which registers the backend once it has run joblib's ``__init__``.

    A loader needs only these two methods; ``importlib.abc`` is not imported for its base class, since it
    imports ``importlib.resources`` and ``pathlib``.
    """

    def __init__(self, loader: Any, finder: _AfterJoblib) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module keeps joblib's own loader: only this one load goes through here.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        try:
            self._loader.exec_module(module)
        except BaseException:
            self._finder.install()  # joblib failed to import: wait for the next attempt
            raise
        _register()


class _AfterJoblib:
    """Finds nothing itself: it hands joblib's spec, found by the finders after it, the loader above."""

    def __init__(self) -> None:
        self._lock = _forksafe.lock()

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname != "joblib":
            return None
        with self._lock:
            if self not in sys.meta_path:
                return None  # another thread's import of joblib took this finder away
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # a loader of another kind: memshare.Parallel still registers the backend when used
        spec.loader = _RegisteringLoader(spec.loader, self)
        return spec

    def install(self) -> None:
        with self._lock:
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)


def register_when_joblib_is_imported() -> None:
    """Register the backend now if joblib is imported, or as soon as it is."""
    if "joblib" in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterJoblib) for finder in sys.meta_path):
        # The finder is the process's one wait for joblib; it removes itself when joblib is found.
        _AfterJoblib().install()
