"""The command line: ``python -m memshare {doctor,clean,bench}`` (or the ``memshare`` script), ``--version``.

``doctor`` checks the machine (see ``doctor``); ``clean`` removes the folders
of owners that died without cleaning up (killed together with their watchdog,
or a machine that lost power mid-cleanup), on local file systems unless given
``--network-fs``, and never another host's; ``bench`` hands its arguments to
``memshare._tools.bench``. Usage lines name the command as it was invoked. Exit
status: 0 when all is well, 1 when doctor found a problem or clean could not
remove something, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .. import __version__
from .._config import format_bytes, parse_max_nbytes
from .._lifetime._location import SHM_ROOT, network_fstype
from .._lifetime._owners import OWNER_ALIVE, OWNER_DEAD, OWNER_OTHER_HOST, OWNER_OTHER_NAMESPACE, OWNER_UNKNOWN_HOST
from .._lifetime._sweep import candidate_bases, find_folders, sweep_dead_owners
from .doctor import run_doctor


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
    clean.add_argument(
        "--network-fs",
        action="store_true",
        help="also sweep locations on network file systems (NFS, Lustre, CIFS...) that other machines may "
        "share; only this host's dead owners' folders are removed there, never another host's",
    )

    commands.add_parser("bench", help="compare memshare with joblib on this machine (see bench --help)")
    return parser


_DEAD_ON_NETWORK = "dead, on a network file system"
#: How ``clean`` counts the folders it keeps, by their owner's status.
_KEPT = {
    OWNER_ALIVE: "of running owners",
    OWNER_OTHER_HOST: "of other hosts (never judged from here)",
    OWNER_OTHER_NAMESPACE: "of other pid namespaces (containers; never judged from here)",
    OWNER_UNKNOWN_HOST: "named by an older memshare on a network file system (their host is unknown)",
    _DEAD_ON_NETWORK: "of dead owners on network file systems (pass --network-fs to remove them)",
}


def clean(shm: str = SHM_ROOT, dry_run: bool = False, network_fs: bool = False) -> int:
    """Remove (or with ``dry_run`` list) dead owners' folders; print each and the total freed.

    Liveness is decided by ``sweep_dead_owners`` (host, pid, start time and
    pid namespace), so a running owner's folder is never touched, nor one of
    another host. Locations on network file systems are searched only with
    ``network_fs``. The sweep ignores removal errors, so each path is checked
    afterwards and a folder that is still there is reported instead of being
    counted as freed.
    """
    bases = candidate_bases() | {shm}
    if not network_fs:
        for base in sorted(bases):
            fstype = network_fstype(base)
            if fstype is not None and os.path.isdir(base):
                print(
                    f"not swept: {base} is on a network file system ({fstype}) that other machines may share; "
                    "pass --network-fs to sweep it (another host's folders are never removed)"
                )
    swept = sweep_dead_owners(bases, dry_run=dry_run, network=network_fs)
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
    kept = {}
    for found in find_folders(bases):
        if found.status != OWNER_DEAD:
            reason = found.status
        elif found.network_fs is not None and not network_fs:
            reason = _DEAD_ON_NETWORK
        else:
            continue  # removed, listed by a dry run, or reported as not removable
        kept[reason] = kept.get(reason, 0) + 1
    verb = "would free" if dry_run else "freed"
    count = len(swept) - failed
    if swept:
        print(f"{verb} {format_bytes(freed)} ({freed} bytes) in {count} folder(s) of dead owners")
    else:
        print(f"nothing to clean: no folders of dead owners in {', '.join(sorted(bases))}")
    for reason, text in _KEPT.items():
        if kept.get(reason):
            print(f"kept {kept[reason]} folder(s) {text}")
    return 1 if failed else 0


def run(argv: Optional[Sequence[str]] = None, prog: str = "python -m memshare") -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "bench":
        # Everything after "bench" belongs to the benchmark's own parser, --help included.
        from . import bench

        return int(bench.main(args[1:], prog=f"{prog} bench") or 0)
    options = build_parser(prog).parse_args(args)
    if options.command == "doctor":
        return run_doctor(shm=options.shm, need=options.need)
    return clean(shm=options.shm, dry_run=options.dry_run, network_fs=options.network_fs)
