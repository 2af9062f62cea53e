"""Another local user who plants a folder where memshare's disk fallback would go.

With named files, a folder ``<base>/memshare-<X>`` shows in a world-readable
place (``/dev/shm``) as soon as it exists. Its disk fallback twin was named
``<tmp>/memshare-<X>-disk``, so another user could create that folder first,
and every array that needed the disk fallback then failed its call with
``PermissionError``. Refusing the planted folder is right; the twin now has a
name of its own, and a twin name that is taken anyway is passed over for a
spare one instead of failing the call.

The planted folder belongs to ``nobody`` (which needs root to create) or is a
symlink (which does not); shared memory is a small tmpfs, so that large arrays
need the fallback (mounting needs root too). CI runs as root.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import numpy as np
import pytest
from conftest import mount_small_tmpfs, unmount

from memshare import Parallel, SharedMemoryFallbackWarning, delayed
from memshare._lifetime._owners import Owner, parse_folder_name
from memshare._lifetime._temp_folder import TempFolder

# Version-independent (folders made and removed concurrently: the kernel and memshare alone): run in CI's whole-suite
# environments only.
pytestmark = pytest.mark.version_independent

NOBODY = 65534
MIB = 1 << 20


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("creating a folder owned by another user (nobody) and mounting a tmpfs need root (CI is root)")


@pytest.fixture
def small_shm(tmp_path):
    """An 8 MiB tmpfs standing for shared memory (root only)."""
    needs_root()
    mount_point = mount_small_tmpfs(tmp_path, "shm", "8m", "to make large arrays need the disk fallback")
    try:
        yield str(mount_point)
    finally:
        unmount(mount_point)


def plant_as_nobody(path: str) -> None:
    """What another user does: a folder of their own at ``path``, open to all."""
    os.mkdir(path, 0o777)
    os.chmod(path, 0o777)
    os.chown(path, NOBODY, NOBODY)


def remove_planted(path: str) -> None:
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.isdir(path):
        os.rmdir(path)


def leftovers(*bases: str) -> list:
    """memshare folders of this process in ``bases``."""
    me = Owner.current()
    return [
        os.path.join(base, entry)
        for base in bases
        for entry in os.listdir(base)
        if parse_folder_name(entry) == me and os.stat(os.path.join(base, entry)).st_uid == os.geteuid()
    ]


def test_a_twin_planted_after_the_folder_appears_does_not_fail_the_call(small_shm):
    """The attack as another user runs it: watch shared memory, plant ``<tmp>/<name>-disk`` at once."""
    planted = None
    try:
        with Parallel(n_jobs=2, temp_folder=small_shm) as parallel:
            assert parallel(delayed(np.sum)(x) for x in [np.ones(MIB // 4)]) == [MIB // 4]  # 2 MiB fits
            (name,) = [entry for entry in os.listdir(small_shm) if entry.startswith("memshare-")]
            planted = os.path.join(tempfile.gettempdir(), name + "-disk")
            plant_as_nobody(planted)
            big = np.arange(2 * MIB, dtype=np.float64)  # 16 MiB: only the disk fallback has room
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sums = parallel(delayed(np.sum)(x) for x in [big])
            assert sums == [big.sum()]
            assert any(issubclass(w.category, SharedMemoryFallbackWarning) for w in caught), caught
            results = parallel(delayed(np.full)(2 * MIB, float(i)) for i in range(2))  # results on disk too
            assert [float(r[-1]) for r in results] == [0.0, 1.0]
            del results
        assert os.stat(planted).st_uid == NOBODY and os.listdir(planted) == [], "the planted folder was touched"
        assert leftovers(small_shm, tempfile.gettempdir()) == [], "a twin outlived its call"
    finally:
        if planted is not None:
            remove_planted(planted)


@pytest.mark.parametrize("how", ["folder of nobody", "symlink"])
def test_a_taken_twin_name_is_passed_over_for_another_one(small_shm, tmp_path, how):
    """Even if the twin's own name were known and taken, the file goes to a spare twin."""
    folder = TempFolder(small_shm)
    pair = folder.pair
    assert pair.fallback is not None
    if how == "symlink":
        os.symlink(str(tmp_path), pair.fallback)
    else:
        plant_as_nobody(pair.fallback)
    try:
        path, fd = pair.create_file(16 * MIB, "dump", warn=False)
        os.close(fd)
        twin = os.path.dirname(path)
        assert twin != pair.fallback and pair.is_fallback(path)
        assert os.path.dirname(twin) == os.path.dirname(pair.fallback)
        assert parse_folder_name(os.path.basename(twin)) == Owner.current() and twin.endswith("-disk")
        info = os.lstat(twin)
        assert info.st_uid == os.geteuid() and info.st_mode & 0o777 == 0o700
        folder.remove()
        assert not os.path.exists(twin), "the spare twin outlived its folder"
        assert os.path.lexists(pair.fallback), "the planted entry is not memshare's to remove"
    finally:
        folder.remove()
        remove_planted(pair.fallback)


def test_the_twin_name_is_not_derived_from_the_visible_name():
    folder = TempFolder()
    pair = folder.pair
    try:
        if pair.fallback is None:
            pytest.skip("shared memory and the temp dir are one file system here: no fallback twin")
        primary, twin = os.path.basename(pair.primary), os.path.basename(pair.fallback)
        assert twin.endswith("-disk") and twin != primary + "-disk"
        assert parse_folder_name(twin) == parse_folder_name(primary) == Owner.current()
    finally:
        folder.remove()
