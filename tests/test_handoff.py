"""Handing result memfds to the parent (``_handoff``): counted per outcome, unreachable by other users, bounded.

The attack tests run as root with a second, unprivileged user (``nobody``)
and skip elsewhere; the rest run anywhere memfds work.
"""

from __future__ import annotations

import functools
import gc
import glob
import os
import pwd
import socket
import sys
import textwrap
import threading
from typing import List, Tuple

import numpy as np
import pytest
from conftest import memfds_held, open_descriptors, run_script

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._config import Settings
from memshare._frontends._executor import current_executor, discard_executor
from memshare._lifetime import _memfd
from memshare._lifetime._folders import FolderPair, delete_file
from memshare._parent._session import Session
from memshare._transport import _handoff
from memshare._transport._protocol import ResultSpec
from memshare._transport._refs import RESULT
from memshare._worker._result_policy import ResultPolicy

pytestmark = pytest.mark.skipif(
    not _memfd.decision().in_memory, reason=f"memfds are not usable here: {_memfd.decision().reason}"
)

#: A bound on waits that must never happen: a hang fails the test instead of the run.
HANG_GUARD = 120


# -- item 4: one worker-owned shared array returned from several tasks -------------------------------


@functools.lru_cache(None)
def dataset():
    return memshare.share(np.arange(4 * 1024 * 1024, dtype=np.float64))


def chunk(i):
    return dataset()[i * 262144 : (i + 1) * 262144]


def two_chunks(i):
    whole = dataset()
    return whole[i * 262144 : (i + 1) * 262144], whole[:8]  # two views of one memfd in one outcome


def _check_chunks(results, offset=0):
    for i, part in enumerate(results):
        i += offset
        assert part.shape == (262144,) and part[0] == i * 262144 and part[-1] == (i + 1) * 262144 - 1


def test_views_of_one_workers_shared_array_from_many_pool_tasks(default_location):
    # The forkserver and memshare's watchdog start once per process: count descriptors after they did.
    with MemmappingPool(2) as pool:
        pool.map(abs, range(4))
    del pool
    gc.collect()
    before, memfds_before = open_descriptors(), len(memfds_held())
    with MemmappingPool(2) as pool:
        for _ in range(5):
            pending = [pool.apply_async(chunk, (i,)) for i in range(16)]
            _check_chunks([task.get(timeout=HANG_GUARD) for task in pending])
        pairs = pool.map(two_chunks, range(16))
        for i, (part, head) in enumerate(pairs):
            assert part[0] == i * 262144 and head.tolist() == list(range(8))
        del pending, pairs, part, head
    del pool  # its queues' pipes close with it
    gc.collect()
    assert len(memfds_held()) == memfds_before
    assert open_descriptors() - before == set()


def test_views_of_one_workers_shared_array_from_many_joblib_tasks(default_location):
    # loky's reusable executor keeps its own pipes across calls: count after a call that starts it.
    Parallel(n_jobs=2)(delayed(abs)(i) for i in range(4))
    gc.collect()
    before, memfds_before = open_descriptors(), len(memfds_held())
    try:
        with Parallel(n_jobs=2) as parallel:
            for _ in range(5):
                _check_chunks(parallel(delayed(chunk)(i) for i in range(16)))
        results = Parallel(n_jobs=2, batch_size=4)(delayed(chunk)(i) for i in range(16))
        _check_chunks(results)
        del results
        gc.collect()
        assert len(memfds_held()) == memfds_before
        assert open_descriptors() - before == set()
    finally:
        executor = current_executor()
        if executor is not None:
            discard_executor(executor)  # its workers cached dataset(): the next test starts with none


def _new_memfd(kind="result", nbytes=4096):
    path, fd = FolderPair("/nonexistent", None, in_memory=True).create_file(nbytes, kind)
    info = os.fstat(fd)
    return path, fd, (info.st_dev, info.st_ino)


def test_an_inbox_counts_descriptors_per_outcome(tmp_path):
    """Three outcomes hand over one memfd each time: each take or discard consumes its own descriptor."""
    gc.collect()
    before = open_descriptors()
    inbox = _handoff.Inbox(str(tmp_path / "inbox"))
    path, fd, identity = _new_memfd("shared")
    try:
        for _ in range(3):
            _handoff.send(inbox.address, os.getpid(), [(fd, identity)])
        first = inbox.take(identity)
        assert first is not None
        os.close(first)
        inbox.discard([identity])  # the second outcome never claimed its descriptor
        assert inbox.held() == 1
        third = inbox.take(identity)
        assert third is not None and (os.fstat(third).st_dev, os.fstat(third).st_ino) == identity
        os.close(third)
        assert inbox.take(identity) is None and inbox.held() == 0
    finally:
        os.close(fd)
        delete_file(path)
        inbox.close()
    assert not os.path.exists(inbox.address)
    assert open_descriptors() - before == set()


# -- item 2: no other user can reach the inbox, and a worker never waits without bound --------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user (nobody)")


def large(n):
    return np.full(n, 3.0)


class Intruder:
    """A forked process of user ``nobody`` that connects to every socket of this process's sessions it can name.

    It finds the abstract ones as anyone can, in /proc/net/unix, and is told
    the paths of the others (more than another user could learn: their
    folder is 0700). It connects ``count`` times to each (closing its end
    each time: the parent's side stays queued until accepted), then reports
    how many sockets it tried and connections it made, and waits to be told
    to go.
    """

    def __init__(self, count: int = 4200) -> None:
        nobody = pwd.getpwnam("nobody")
        parent = os.getpid()
        self._go_read, self._go_write = os.pipe()
        self._report_read, self._report_write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: no return from here
            try:
                os.close(self._go_write)
                os.close(self._report_read)
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                told = b""
                while not told.endswith(b"\0"):
                    told += os.read(self._go_read, 4096)
                paths = [os.fsdecode(path) for path in told[:-1].split(b"\n") if path]
                found, made = self._connect_everywhere(parent, paths, count)
                os.write(self._report_write, f"{found} {made}\n".encode())
                os.read(self._go_read, 1)
            finally:
                os._exit(0)
        os.close(self._go_read)
        os.close(self._report_write)

    @staticmethod
    def _connect_everywhere(parent: int, paths: List[str], count: int) -> Tuple[int, int]:
        with open("/proc/net/unix") as table:
            # Only this test's parent: other memshare processes of the machine are left alone.
            names = [line.split()[-1] for line in table if f"@memshare-{parent}-" in line]
        addresses = {"\0" + name[1:] for name in names} | set(paths)
        made = 0
        for address in addresses:
            for _ in range(count):
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                connection.setblocking(False)
                try:
                    connection.connect(address)
                    made += 1
                except OSError:
                    break  # refused (no permission), or the queue is full: the attack is done
                finally:
                    connection.close()
        return len(addresses), made

    def attack(self, paths: List[str]) -> Tuple[int, int]:
        """Run the attack now, on ``paths`` too; the number of sockets it tried, and of connections it made."""
        os.write(self._go_write, b"\n".join(os.fsencode(path) for path in paths) + b"\0")
        report = b""
        while not report.endswith(b"\n"):
            report += os.read(self._report_read, 64)
        found, made = report.split()
        return int(found), int(made)

    def stop(self) -> None:
        os.close(self._go_write)
        os.close(self._report_read)
        os.waitpid(self.pid, 0)


@needs_root
def test_another_user_cannot_reach_or_block_the_result_inbox(default_location):
    intruder = Intruder()
    try:
        with MemmappingPool(1, max_nbytes=1024) as pool:
            assert pool.apply_async(large, (1000,)).get(timeout=HANG_GUARD)[0] == 3.0  # the workers are up
            sockets = glob.glob(f"/dev/shm/memshare-{os.getpid()}-*/inbox-*.sock")
            found, made = intruder.attack(sockets)
            results = [pool.apply_async(large, (100_000 + i,)) for i in range(4)]
            values = [task.get(timeout=30) for task in results]  # a hang is the failure this test looks for
        assert [v.size for v in values] == [100_000 + i for i in range(4)] and all((v == 3.0).all() for v in values)
        assert found >= 1 and made == 0  # nobody saw the inbox, and could not connect to it at all
    finally:
        intruder.stop()


def test_a_full_inbox_queue_makes_results_named_files_at_once(tmp_path):
    """Whoever fills the inbox's queue (another user, where the socket cannot be private), no worker waits."""
    inbox = _handoff.Inbox(None)  # the abstract namespace: the fallback where no private folder can be made
    assert inbox.address.startswith("\0")
    fillers = []
    try:
        while True:  # fill the queue of connections not accepted yet
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            connection.setblocking(False)
            try:
                connection.connect(inbox.address)
            except BlockingIOError:
                connection.close()
                break
            fillers.append(connection)
        spec = ResultSpec(FolderPair(str(tmp_path / "results"), None, True), 1024, inbox.address, os.getpid())
        outcome = {}

        def worker():
            policy = ResultPolicy(spec)
            outcome["slot"] = policy.slot_of(np.full(10_000, 5.0))
            policy.write_pending()
            policy.send_memfds()
            outcome["slots"] = list(policy.slots)

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        thread.join(HANG_GUARD)
        assert not thread.is_alive(), "a worker waited for a full inbox"
        (ref,) = outcome["slots"]
        assert ref.kind == RESULT and not _memfd.is_memfd_path(ref.path)  # a named result file instead
        assert np.fromfile(ref.path, np.float64).tolist() == [5.0] * 10_000
        os.unlink(ref.path)
    finally:
        for connection in fillers:
            connection.close()
        inbox.close()


def test_the_inbox_is_a_private_socket_in_the_sessions_folder_and_goes_with_it(default_location):
    session = Session(Settings(max_nbytes=1024))
    try:
        address = session.pack_task(np.full, ((10,), 1.0)).results.inbox
        folder = session.folder.pair.primary
        assert address.startswith(f"/proc/{os.getpid()}/fd/") and len(os.fsencode(address)) < 108
        assert os.path.samefile(os.path.dirname(address), folder) and os.stat(folder).st_mode & 0o777 == 0o700
        (name,) = os.listdir(folder)
        assert name == os.path.basename(address) and os.stat(address).st_mode & 0o777 == 0o600
    finally:
        session.close()
    assert not os.path.exists(folder)


def test_an_inbox_in_a_folder_with_a_long_path_still_works(tmp_path):
    folder = tmp_path / ("a" * 60) / ("b" * 60)
    inbox = _handoff.Inbox(str(folder))
    path, fd, identity = _new_memfd()
    try:
        assert len(os.fsencode(str(folder))) > 108 and os.path.samefile(os.path.dirname(inbox.address), folder)
        _handoff.send(inbox.address, os.getpid(), [(fd, identity)])
        received = inbox.take(identity)
        assert received is not None
        os.close(received)
    finally:
        os.close(fd)
        delete_file(path)
        inbox.close()


# -- item 5, worker side: results under a low descriptor limit ---------------------------------------

LOW_LIMIT_SCRIPT = """
    import resource, sys, warnings
    import numpy as np
    from memshare import MemmappingPool

    LIMIT = int(sys.argv[1])

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    def many(i):
        return [np.full(1024, float(i)) for _ in range(100)]  # 100 arrays of 8 KB

    if __name__ == "__main__":
        # Only the workers get the low limit: the parent keeps every adopted result open.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            with MemmappingPool(2, initializer=low_limit, max_nbytes=1024) as pool:
                out = pool.map(many, range(12))
        assert len(out) == 12 and all(len(r) == 100 for r in out)
        assert all((a == i).all() for i, r in enumerate(out) for a in r)
        print("OK", [str(w.message) for w in caught])
"""


@pytest.mark.parametrize("limit", [200, 64])
def test_results_arrive_from_workers_with_few_descriptors(default_location, limit):
    """The parent side (adopted results keep a descriptor) is left out: the parent's limit is raised."""
    hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[1]
    if hard != -1 and hard < 1400:
        pytest.skip(f"the parent needs about 1300 descriptors for the results it adopts (hard limit {hard})")
    done = run_script(textwrap.dedent(LOW_LIMIT_SCRIPT).replace("sys.argv[1]", str(limit)), timeout=HANG_GUARD)
    assert done.stdout.startswith("OK"), done.stdout + done.stderr
    assert "no room" not in done.stdout + done.stderr, done.stdout + done.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# -- two views of one result, when the parent cannot take the memfd --------------------------------


def _two_views_while_the_parent_is_busy(busy: bool):
    """In the worker: make the parent's inbox refuse descriptors (if ``busy``), return two views of one array."""
    import errno

    from memshare._transport import _handoff as handoff

    if busy:

        def refuse(*args, **kwargs):
            raise BlockingIOError(errno.EAGAIN, "the parent cannot take descriptors now (test)")

        handoff.send_on = refuse  # this worker only: its pool ends with the test
    from memshare._transport._backing import find_backing

    whole = memshare.share(np.arange(400_000, dtype=np.float64))  # both views above max_nbytes
    return whole[10:200_000], whole[150_000:], _memfd.is_memfd_path(find_backing(whole).path)


@pytest.mark.parametrize("busy", [False, True], ids=["handed-over", "copied-to-a-named-file"])
def test_two_views_of_one_returned_array_share_one_adopted_file(default_location, busy):
    with MemmappingPool(1) as pool:
        head, tail, in_memfd = pool.apply(_two_views_while_the_parent_is_busy, (busy,))
        pool.close()
        pool.join()
    assert head[0] == 10.0 and head[-1] == 199_999.0 and tail[0] == 150_000.0 and tail.shape == (250_000,)
    if not in_memfd:
        # A worker started with named files for shared arrays (its fork server inherited an earlier test's
        # settings): each view may have been copied on its own, which this test is not about.
        return
    head[150_000 - 10] = -1.0
    assert tail[0] == -1.0  # both views map one file in the parent, as in the worker
