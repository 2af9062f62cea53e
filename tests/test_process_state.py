"""Process-wide state stays bounded: what a removed folder left behind goes with it."""

from __future__ import annotations

import warnings

import memshare
from memshare._lifetime import _folder_warnings, _temp_folder


def test_fallback_warnings_are_forgotten_with_their_folder(tmp_path):
    primary, used = str(tmp_path / "memshare-primary"), str(tmp_path / "disk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _folder_warnings.warn_fallback(primary, used, 10)
        _folder_warnings.warn_fallback(primary, used, 10)  # once per folder
    assert len([w for w in caught if issubclass(w.category, memshare.SharedMemoryFallbackWarning)]) == 1
    assert any(key[0] == primary for key in _folder_warnings._warned)
    _temp_folder._remove_paths([primary])
    assert not any(key[0] == primary for key in _folder_warnings._warned)
