"""One shared file's lifetime: it goes once, when it is neither current nor read."""

from __future__ import annotations

import gc
import os

from memshare._lifetime._file_lifetime import FileLifetime


def lifetime(readers: int = 0):
    deleted = []
    return FileLifetime("/some/file", lambda: deleted.append(True), readers), deleted


def test_a_current_file_stays_whoever_releases_it():
    file, deleted = lifetime(readers=1)
    file.acquire()
    assert not file.release() and not file.release()
    assert deleted == [] and file.readers == 0 and not file.deleted


def test_a_retired_file_goes_with_its_last_reader():
    file, deleted = lifetime()
    file.acquire()
    file.acquire()
    assert not file.retire()  # read: it stays
    assert not file.release()
    assert deleted == []
    assert file.release()
    assert deleted == [True] and file.deleted


def test_a_retired_file_nobody_reads_goes_at_once_and_only_once():
    file, deleted = lifetime()
    assert file.retire()
    assert not file.retire() and not file.release()
    assert deleted == [True]
    assert "deleted" in repr(file)


def test_ending_a_file_deletes_it_though_it_is_read_and_only_once():
    file, deleted = lifetime(readers=2)
    assert file.end()
    assert deleted == [True] and file.deleted and file.readers == 0
    assert not file.end() and not file.retire()
    assert deleted == [True]


def test_a_temp_folder_is_a_file_lifetime_with_one_owner(tmp_path):
    from memshare._lifetime._temp_folder import TempFolder, live_folders

    removed = TempFolder(str(tmp_path))
    collected = TempFolder(str(tmp_path))
    paths = [removed.pair.primary, collected.pair.primary]
    for path in paths:
        os.mkdir(path, 0o700)
    assert removed.lifetime.current and not removed.lifetime.deleted
    removed.remove()
    assert removed.lifetime.deleted and not os.path.exists(paths[0])
    removed.remove()  # once only
    lifetime = collected.lifetime
    del collected
    gc.collect()
    assert lifetime.deleted and not os.path.exists(paths[1])
    assert not set(paths) & set(live_folders())
