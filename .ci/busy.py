"""A busy neighbour for the suite: allocates and frees private and shared memory until killed.

CI runs the suite once beside it, so that tests which measure memory show they
measure their own and not the machine's. Its shared memory is a memfd, so that
nothing is left behind when it is killed.
"""

import os
import time

MIB = 1 << 20
PRIVATE = 96 * MIB  # bytes(...) of this size: pages really touched, then freed
SHARED = 48 * MIB  # a memfd filled, held a moment, then closed
PAUSE = 0.5  # seconds between steps: a neighbour that churns memory, not one that takes a core


def main() -> None:
    block = b"\1" * MIB
    while True:
        private = b"\2" * PRIVATE
        shared = os.memfd_create("ci-busy-neighbour")
        for _ in range(SHARED // MIB):
            os.write(shared, block)
        time.sleep(PAUSE)
        os.close(shared)
        del private
        time.sleep(PAUSE)


if __name__ == "__main__":
    main()
