"""Print the memshare folders in /dev/shm and the temp dir, one path a line.

A name counts when memshare's own owner parsing accepts it (``_owners.parse_folder_name``,
as ``python -m memshare clean`` does): other entries called ``memshare-*`` (a virtual
environment, a clone, a note) are not memshare's. ``_owners`` is loaded from the
checkout by its path and uses the standard library only, so this runs before any install.
"""

import importlib.util
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_owners():
    spec = importlib.util.spec_from_file_location(
        "_memshare_owners", os.path.join(ROOT, "src", "memshare", "_lifetime", "_owners.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


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
