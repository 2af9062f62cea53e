"""Print the memshare folders in /dev/shm and the temp dir, one path a line.

A name counts when memshare's own owner parsing accepts it (``_owners.parse_folder_name``,
as ``python -m memshare clean`` does): other entries called ``memshare-*`` (a virtual
environment, a clone, a note) are not memshare's. ``_owners`` is loaded from the
checkout's folder, as a module of a package that runs no ``__init__``: it and the ``_procfs``
it reads ``/proc`` through use the standard library only, so this runs before any install.
"""

import importlib
import os
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_owners():
    """memshare's ``_owners`` from the checkout, without running the package's ``__init__`` (numpy not needed)."""
    package = types.ModuleType("_memshare_lifetime")
    package.__path__ = [os.path.join(ROOT, "src", "memshare", "_lifetime")]
    sys.modules[package.__name__] = package
    return importlib.import_module("_memshare_lifetime._owners")


def main() -> None:
    parse_folder_name = load_owners().parse_folder_name
    for base in ("/dev/shm", tempfile.gettempdir()):
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for name in names:
            if parse_folder_name(name) is not None:
                print(os.path.join(base, name))


if __name__ == "__main__":
    main()
