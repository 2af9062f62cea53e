"""numpy, imported on first use: a process that meets no array never imports it.

A pool whose tasks carry only plain objects, its workers and its fork server
then skip numpy's import (about as long as the rest of memshare's). Modules
write ``from .._numpy import np`` and use ``np`` as the module: the first
attribute read imports numpy. Code on a path that every object takes (the
picklers' type checks, the routes of argument objects) asks
:func:`numpy_imported` first, since no object can be an array before numpy
is imported. A class-body annotation never starts with ``np.``: from Python
3.15, ``@dataclass`` reads a field annotation's leading dotted name, which
would import numpy with the module (``Any`` stands there instead).
"""

from __future__ import annotations

import sys
from typing import Any


class _NumpyOnFirstUse:
    """Stands for the ``numpy`` module; the first attribute read imports it.

    Each name read is kept on the instance, so the next read is a plain
    attribute lookup. The names are numpy's own objects, the same in every
    thread, so two threads reading one at once keep the same value.
    """

    def __getattr__(self, name: str) -> Any:
        import numpy

        value = getattr(numpy, name)
        setattr(self, name, value)
        return value

    def __repr__(self) -> str:
        return "<numpy, imported on first use>"


# Process-wide like the module it stands for; it holds only numpy's own names.
np: Any = _NumpyOnFirstUse()


def numpy_imported() -> bool:
    """True once the process has imported numpy: before that no object is an array, a dtype or a numpy scalar."""
    return "numpy" in sys.modules


__all__ = ["np", "numpy_imported"]
