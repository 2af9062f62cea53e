"""Entry point of ``python -m memshare`` and of the ``memshare`` console script."""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    from ._cli import run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
