"""Make memshare folders of a live process that is not memshare's, and print their paths, one a line.

``python3 .ci/live_folders.py PID BASE...``: under each base, one folder named
by memshare's own ``new_folder_name`` for the live process ``PID`` (a ``sleep``
the CI started) as an owner of this host, and one for the same process as an
owner of another, made-up host. Each holds one small file. The suite runs
beside them: no sweep, ``clean`` or count of its own may take or count them.
``_owners`` is loaded from the checkout by its path (see ``memshare_folders.py``).
"""

import os
import sys

from memshare_folders import load_owners


def main() -> None:
    owners = load_owners()
    pid, bases = int(sys.argv[1]), sys.argv[2:]
    start = owners.process_start_time(pid)
    if start is None:
        sys.exit(f"live_folders: no process {pid}")
    here = owners.host_identity()
    elsewhere = "0123456789" if here != "0123456789" else "9876543210"
    for base in bases:
        for host in (here, elsewhere):
            path = os.path.join(base, owners.new_folder_name(owners.Owner(pid, start, owners.pid_namespace(), host)))
            os.mkdir(path, 0o700)
            with open(os.path.join(path, "dump-0123456789abcdef.bin"), "wb") as data:
                data.write(b"\1" * 4096)
            print(path)


if __name__ == "__main__":
    main()
