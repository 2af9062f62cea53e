"""The command line: ``python -m memshare {doctor,clean,bench}`` (or the ``memshare`` script), ``--version``.

``doctor`` checks the machine (see ``_doctor``); ``clean`` removes the folders
of owners that died without cleaning up (killed together with their watchdog,
or a machine that lost power mid-cleanup); ``bench`` hands its arguments to
``memshare._bench``. Usage lines name the command as it was invoked. Exit
status: 0 when all is well, 1 when doctor found a problem or clean could not
remove something, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from . import __version__
from ._config import format_bytes, parse_max_nbytes
from ._doctor import run_doctor
from ._folders import SHM_ROOT, candidate_bases, list_folders, sweep_dead_owners


def _size(text: str) -> int:
    try:
        return parse_max_nbytes(text) or 0
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser(prog: str = "python -m memshare") -> argparse.ArgumentParser:
    """The argument parser, with one subcommand per task; ``prog`` is the command's name in usage lines."""
    parser = argparse.ArgumentParser(prog=prog, description="Check, clean and benchmark memshare's shared memory.")
    parser.add_argument("--version", action="version", version=f"memshare {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{doctor,clean,bench}")
    commands.required = True
    shm_help = f"the shared memory location to check and search for folders (default {SHM_ROOT})"

    doctor = commands.add_parser("doctor", help="check shared memory, leftovers and versions; exit 1 on a problem")
    doctor.add_argument("--shm", default=SHM_ROOT, metavar="PATH", help=shm_help)
    doctor.add_argument(
        "--need",
        type=_size,
        default=0,
        metavar="SIZE",
        help="the largest amount of data you share at once, e.g. 4G: shared memory must hold twice that",
    )

    clean = commands.add_parser("clean", help="remove the folders of dead owners (never a live owner's)")
    clean.add_argument("--shm", default=SHM_ROOT, metavar="PATH", help="also search this location")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")

    commands.add_parser("bench", help="compare memshare with joblib on this machine (see bench --help)")
    return parser


def clean(shm: str = SHM_ROOT, dry_run: bool = False) -> int:
    """Remove (or with ``dry_run`` list) dead owners' folders; print each and the total freed.

    Liveness is decided by ``sweep_dead_owners`` (pid, start time and pid
    namespace), so a running owner's folder is never touched. The sweep
    ignores removal errors, so each path is checked afterwards and a folder
    that is still there is reported instead of being counted as freed.
    """
    bases = candidate_bases() | {shm}
    swept = sweep_dead_owners(bases, dry_run=dry_run)
    freed, failed = 0, 0
    for path, size in swept:
        if dry_run:
            print(f"would remove {path} ({format_bytes(size)})")
            freed += size
        elif os.path.lexists(path):
            print(f"could not remove {path}: check its permissions", file=sys.stderr)
            failed += 1
        else:
            print(f"removed {path} ({format_bytes(size)})")
            freed += size
    kept = sum(1 for _, owner in list_folders(bases) if owner.is_alive())
    verb = "would free" if dry_run else "freed"
    count = len(swept) - failed
    if swept:
        print(f"{verb} {format_bytes(freed)} ({freed} bytes) in {count} folder(s) of dead owners")
    else:
        print(f"nothing to clean: no folders of dead owners in {', '.join(sorted(bases))}")
    if kept:
        print(f"kept {kept} folder(s) of running owners")
    return 1 if failed else 0


def run(argv: Optional[Sequence[str]] = None, prog: str = "python -m memshare") -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "bench":
        # Everything after "bench" belongs to the benchmark's own parser, --help included.
        from . import _bench

        return int(_bench.main(args[1:], prog=f"{prog} bench") or 0)
    options = build_parser(prog).parse_args(args)
    if options.command == "doctor":
        return run_doctor(shm=options.shm, need=options.need)
    return clean(shm=options.shm, dry_run=options.dry_run)
