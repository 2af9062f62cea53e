"""polars DataFrames and Series pickled through Arrow, so that their large buffers travel out of band.

polars pickles a ``DataFrame`` or ``Series`` by serializing it to bytes: the
whole of its data inside the stream, copied for every task or result, and
copied again into new memory by the receiver. Its Arrow export (``to_arrow``
at polars' newest compatibility level, with ``string_view`` strings) and
import (``polars.from_arrow``) are zero-copy for most types, and pyarrow
pickles Arrow data with out-of-band buffers. Reduced through Arrow, a frame's
large buffers take the road of every out-of-band buffer (``_reducers``): an
argument's written once per call to shared memory, a result's to a result
file, and the receiver's polars object is built over those mappings without
a copy. An argument's mappings are read-only, as pyarrow expects: polars
treats imported Arrow memory as shared and copies before changing it (so do
in-place ``scatter``, ``extend``, ``append`` and item assignment), and a write
would fault rather than reach the dump or the parent.

Only when it is safe and pays:

* polars must already be imported by the sender: memshare never imports it
  there (a receiver of a polars object imports it, as polars' pickle would).
* buffers must be able to leave the stream (``max_nbytes`` is not None), and
  the object must weigh at least :data:`SMALL` (a fixed size: the pickler
  does not know the call's ``max_nbytes``); smaller ones are pickled by
  polars, as before: rebuilding from Arrow costs about 0.25 ms, which only
  buffers sent out of band repay.
* the object must come back as pickle gives it: the same names, dtypes
  (checked by rebuilding an empty slice of the frame from its Arrow schema)
  and values, and the sorted flags, which polars' pickle keeps and Arrow
  does not (restored with ``set_sorted``). Anything else is pickled by
  polars: a dtype Arrow lacks (``Int128``, ``Object``, whose Arrow export is
  the objects' addresses), a pyarrow without view types, a polars without
  ``CompatLevel``, or any failure to export. The chunk layout is the
  frame's own, where polars' pickle joins the chunks.

Only public polars API is used. A ``Categorical`` column's Arrow export is a
new array each time (polars 2 remaps its codes), so its codes are written once
per task instead of once per call; the other dtypes export their own memory.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Tuple

#: Frames whose ``estimated_size()`` is below this many bytes (joblib's default ``max_nbytes``) are pickled by polars.
SMALL = 1 << 20

#: A pickle reduction: (callable, arguments).
Reduction = Tuple[Callable[..., Any], tuple]


def classes() -> Tuple[type, ...]:
    """``(polars.DataFrame, polars.Series)`` when polars is imported and exports by compatibility level; else ()."""
    polars = sys.modules.get("polars")
    if polars is None or getattr(polars, "CompatLevel", None) is None:
        return ()
    found = (getattr(polars, "DataFrame", None), getattr(polars, "Series", None))
    return tuple(cls for cls in found if isinstance(cls, type))


def reduction(obj: Any) -> Optional[Reduction]:
    """How a polars ``DataFrame`` or ``Series`` pickles through Arrow; None: let polars pickle it."""
    polars = sys.modules.get("polars")
    if polars is None:
        return None
    try:
        series = isinstance(obj, polars.Series)
        if obj.estimated_size() < SMALL:
            return None
        frame = obj.to_frame() if series else obj
        level = polars.CompatLevel.newest()
        # The schema's round trip, on no rows: cheap, and it fails or differs for
        # what Arrow cannot carry as polars had it.
        empty = frame.head(0).to_arrow(compat_level=level)
        if not _same_schema(polars.from_arrow(empty, rechunk=False).schema, frame.schema):
            return None
        table = frame.to_arrow(compat_level=level)
        if not table.schema.equals(empty.schema, check_metadata=True):
            return None
        flags = _sorted_columns(frame)
    except Exception:  # any failure to export: polars pickles it, and raises its own errors if it cannot
        return None
    return _from_arrow, (table, series, flags)


def _same_schema(rebuilt: Any, original: Any) -> bool:
    """The same names and dtypes in the same order; dtypes compared by value and by repr (time zones, categories)."""
    mine, theirs = list(rebuilt.items()), list(original.items())
    return len(mine) == len(theirs) and all(
        a_name == b_name and a == b and repr(a) == repr(b) for (a_name, a), (b_name, b) in zip(mine, theirs)
    )


def _sorted_columns(frame: Any) -> Tuple[Tuple[str, bool], ...]:
    """(name, descending) of each column that polars knows to be sorted."""
    found: List[Tuple[str, bool]] = []
    for column in frame.get_columns():
        flags = column.flags
        if flags.get("SORTED_ASC") or flags.get("SORTED_DESC"):
            found.append((column.name, bool(flags.get("SORTED_DESC"))))
    return tuple(found)


def _from_arrow(table: Any, series: bool, sorted_columns: Tuple[Tuple[str, bool], ...]) -> Any:
    """The receiver's polars object over ``table``'s buffers (no copy), with its sorted flags."""
    import polars  # the sender's objects were polars ones: the receiver needs it, as polars' own pickle would

    frame = polars.from_arrow(table, rechunk=False)
    if sorted_columns:
        frame = frame.with_columns(
            [frame.get_column(name).set_sorted(descending=descending) for name, descending in sorted_columns]
        )
    return frame.to_series() if series else frame


__all__ = ["SMALL", "classes", "reduction"]
