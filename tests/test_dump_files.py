"""A session's dump files: deleted through their lifetimes, idle and recent ones kept by their rules."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from memshare._parent._dump_files import IDLE, RECENT, DumpFiles, Uses
from memshare._transport._refs import DUMP, ArrayRef


class Owner:
    """Stands for what a file holds (an array's entry, a buffer's export): it must not outlive the file."""

    def __init__(self):
        self.gone = []

    def on_gone(self, file):
        self.gone.append(file.ref.path)


def ref(name: str, nbytes: int = 100) -> ArrayRef:
    return ArrayRef(f"/dev/shm/{name}", 1, hash(name) & 0xFFFF, DUMP, "r", 0, (nbytes,), (1,), np.dtype(np.uint8))


def table():
    deleted = []
    return DumpFiles(deleted.append), deleted


def add(files, name, rule, nbytes=100, uses=None):
    owner = Owner()
    return files.add(ref(name, nbytes), uses or Uses(), rule, owner.on_gone), owner


def test_a_file_read_by_tasks_goes_once_retired_and_released_by_the_last():
    files, deleted = table()
    file, owner = add(files, "a", IDLE)
    first, second = [], []
    files.use(file, first)
    files.use(file, second)
    files.retire(file)
    files.release(first)
    assert deleted == [] and "/dev/shm/a" in files.paths
    files.release(second)
    assert deleted == ["/dev/shm/a"] and owner.gone == ["/dev/shm/a"] and "/dev/shm/a" not in files.paths
    files.release(second)  # a task released twice (abandoned, then closed) changes nothing
    assert deleted == ["/dev/shm/a"]


def test_a_shared_file_stays_while_current_and_an_idle_one_goes_for_room():
    files, deleted = table()
    shared, _ = add(files, "shared", IDLE)
    for _ in range(2):
        files.use(shared, task := [])
        files.release(task)
    idle, _ = add(files, "idle", IDLE, nbytes=300)
    files.use(idle, task := [])
    files.release(task)
    assert deleted == []
    files.make_room()  # no task reads anything: idle files may weigh nothing
    assert deleted == ["/dev/shm/idle"]
    files.make_room()
    assert deleted == ["/dev/shm/idle"]  # the shared one is not idle


def test_idle_files_go_oldest_first_down_to_what_pending_tasks_read():
    files, deleted = table()
    for name in "abc":
        file, _ = add(files, name, IDLE)
        files.use(file, task := [])
        files.release(task)
    reading, _ = add(files, "reading", IDLE, nbytes=200)
    files.use(reading, [])
    files.make_room()
    assert deleted == ["/dev/shm/a"]  # 300 idle bytes against 200 read: the oldest goes


def test_an_array_used_again_after_its_idle_file_went_is_shared():
    files, deleted = table()
    uses = Uses()
    first, _ = add(files, "first", IDLE, uses=uses)
    files.use(first, task := [])
    files.release(task)
    files.make_room()
    second, _ = add(files, "second", IDLE, uses=uses)  # the same array written again
    files.use(second, task := [])
    files.release(task)
    files.make_room()
    assert deleted == ["/dev/shm/first"]


def test_recent_single_use_files_are_kept_for_two_later_tasks():
    files, deleted = table()
    names = ["one", "two", "three", "four"]
    for name in names:
        file, _ = add(files, name, RECENT)
        files.use(file, task := [])
        files.release(task)
        files.make_room()  # recent files are not idle ones
    assert deleted == ["/dev/shm/one", "/dev/shm/two"]
    again = files.get("/dev/shm/three")
    files.use(again, task := [])  # used again: no longer among the recent, and now shared
    for name in ["five", "six", "seven"]:
        file, _ = add(files, name, RECENT)
        files.use(file, other := [])
        files.release(other)
    assert "/dev/shm/three" not in deleted
    files.release(task)
    assert "/dev/shm/three" not in deleted


def test_closing_deletes_every_file_read_or_not_once():
    files, deleted = table()
    read, _ = add(files, "read", IDLE)
    files.use(read, task := [])
    add(files, "unread", RECENT)
    files.close()
    assert sorted(deleted) == ["/dev/shm/read", "/dev/shm/unread"] and not files.paths
    files.release(task)
    files.close()
    assert len(deleted) == 2


def test_a_deleted_file_lets_go_of_its_owner_without_a_collection():
    files, deleted = table()
    owner = Owner()
    file = files.add(ref("a"), Uses(), RECENT, owner.on_gone)
    owner.file = file  # the owner and its file name each other, as a buffer's entry and its file do
    watched, watched_file = weakref.ref(owner), weakref.ref(file)
    del owner
    gc.disable()
    try:
        files.retire(file)
        del file
        assert watched() is None and watched_file() is None  # freed by their counts: no cycle left
    finally:
        gc.enable()
    assert deleted == ["/dev/shm/a"]
