"""Looking a name up: the small probes the checks and the shims share, and the lazy imports of joblib and loky."""

from __future__ import annotations

import inspect
import re
from types import ModuleType
from typing import Any, List

# joblib and loky are imported on first use, not with this package: a MemmappingPool needs neither, and its
# workers would otherwise import them, which costs more than the rest of memshare.


def joblib_parallel() -> ModuleType:
    import joblib.parallel

    return joblib.parallel


def loky_process_executor() -> ModuleType:
    from joblib.externals.loky import process_executor

    return process_executor


def loky_resource_tracker() -> ModuleType:
    from joblib.externals.loky.backend import resource_tracker

    return resource_tracker


def has(owner: Any, attribute: str) -> bool:
    return hasattr(owner, attribute)


def takes_parameter(function: Any, name: str) -> bool:
    return name in inspect.signature(function).parameters


def exit_codes_in(text: str) -> List[int]:
    return [int(code) for code in re.findall(r"\((-?\d+)\)", text)]


def uses_attribute(cls: type, attribute: str) -> bool:
    """True when a method of ``cls`` (or of a base) reads or sets ``self.<attribute>``.

    Instance attributes exist only on instances; their names do appear in the
    code of the methods that set them, without making an instance.
    """
    for klass in getattr(cls, "__mro__", ()):
        for member in vars(klass).values():
            code = getattr(getattr(member, "__func__", member), "__code__", None)
            if code is not None and attribute in code.co_names:
                return True
    return False
