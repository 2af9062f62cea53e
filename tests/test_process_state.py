"""Process-wide state stays bounded: what a removed folder left behind goes with it."""

from __future__ import annotations

import warnings

import memshare
from memshare import _folders


def test_fallback_warnings_are_forgotten_with_their_folder(tmp_path):
    primary, used = str(tmp_path / "memshare-primary"), str(tmp_path / "disk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _folders.warn_fallback(primary, used, 10)
        _folders.warn_fallback(primary, used, 10)  # once per folder
    assert len([w for w in caught if issubclass(w.category, memshare.SharedMemoryFallbackWarning)]) == 1
    assert any(key[0] == primary for key in _folders._warned)
    _folders._remove_paths([primary])
    assert not any(key[0] == primary for key in _folders._warned)
