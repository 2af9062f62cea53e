"""Entry point of ``python -m memshare`` and of the ``memshare`` console script."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence


def invoked_name(argv0: str) -> str:
    """The command as the user typed it: ``memshare`` for the console script, else ``python -m memshare``."""
    name = os.path.basename(argv0 or "")
    if name in ("", "-c", "-m", "__main__.py") or name.startswith("python"):
        return "python -m memshare"
    return name


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    from ._tools.cli import run

    return run(argv, prog=invoked_name(sys.argv[0] if sys.argv else ""))


if __name__ == "__main__":
    sys.exit(main())
