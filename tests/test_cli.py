"""The command line, run as users run it: ``python -m memshare ...`` in a subprocess.

Leftover folders are made in a pytest tmp dir that the CLI is pointed at with
MEMSHARE_TEMP_FOLDER, and the CLI's /dev/shm and temp dir are the test's own
(``private_bases``), so the tests never depend on other programs' folders there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import without_location_settings

from memshare._lifetime._owners import Owner, host_identity, new_folder_name, pid_namespace, process_start_time

# Version-independent (the command-line tools over folders and processes: the kernel and memshare alone): run in CI's
# whole-suite environment (main) only.
pytestmark = pytest.mark.version_independent

MIB = 1024 * 1024


#: The test's own shared memory root and temp dir (``private_bases``), set by the ``base`` fixture.
_private = None


def run_cli(*args: str, base=None) -> subprocess.CompletedProcess:
    """``python -m memshare *args``; with ``base``, it sees only the test's folders, ``base`` as its temp folder."""
    if base is None:
        command, env = [sys.executable, "-m", "memshare", *args], without_location_settings()
    else:
        command, env = _private.command(*args), _private.env(base)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def dead_owner() -> Owner:
    """An owner in our pid namespace whose process has exited and been reaped."""
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    return Owner(child.pid, 12345, pid_namespace(), host_identity())


def make_folder(base, owner: Owner, nbytes: int = MIB) -> str:
    path = os.path.join(str(base), new_folder_name(owner))
    os.makedirs(path, mode=0o700)
    with open(os.path.join(path, "array-0.bin"), "wb") as data:
        data.write(b"\1" * nbytes)
    return path


@pytest.fixture
def base(tmp_path, private_bases, monkeypatch):
    monkeypatch.setitem(globals(), "_private", private_bases)
    folder = tmp_path / "base"
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_doctor_ok_on_healthy_machine(base):
    result = run_cli("doctor", base=base)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK:" in result.stdout and "PROBLEM" not in result.stdout
    assert f"{base} (because the MEMSHARE_TEMP_FOLDER environment variable)" in result.stdout
    for name in ("numpy", "joblib", "loky", "memshare", "start method"):
        assert name in result.stdout


def test_doctor_reports_the_versions_in_use(base):
    import platform

    import joblib
    import numpy
    from joblib.externals import loky

    result = run_cli("doctor", base=base)
    for line in (
        f"python {platform.python_version()}",
        f"numpy {numpy.__version__}",
        f"joblib {joblib.__version__}",
        f"loky {loky.__version__} (bundled with joblib",
    ):
        assert line in result.stdout, result.stdout


def test_doctor_flags_dead_owner_leftovers(base):
    path = make_folder(base, dead_owner())
    result = run_cli("doctor", base=base)
    assert result.returncode == 1, result.stdout
    assert f"{path}: pid" in result.stdout and "owner dead" in result.stdout
    assert "PROBLEM:" in result.stdout and "python -m memshare clean" in result.stdout
    assert os.path.isdir(path), "doctor must never remove anything"


def test_clean_dry_run_lists_but_keeps(base):
    path = make_folder(base, dead_owner())
    result = run_cli("clean", "--dry-run", base=base)
    assert result.returncode == 0, result.stderr
    assert f"would remove {path} (1.0 MiB)" in result.stdout
    assert os.path.isdir(path)


def test_clean_removes_dead_and_reports_bytes(base):
    path = make_folder(base, dead_owner())
    result = run_cli("clean", base=base)
    assert result.returncode == 0, result.stderr
    assert f"removed {path} (1.0 MiB)" in result.stdout
    assert f"freed 1.0 MiB ({MIB} bytes)" in result.stdout
    assert not os.path.exists(path)
    assert run_cli("doctor", base=base).returncode == 0


def test_clean_never_removes_live_owner(base):
    live = make_folder(base, Owner.current())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        child_owner = Owner(child.pid, process_start_time(child.pid), pid_namespace(), host_identity())
        live_child = make_folder(base, child_owner)
        other_namespace = make_folder(base, Owner(dead_owner().pid, 1, pid_namespace() + 1, host_identity()))
        dead = make_folder(base, dead_owner())
        result = run_cli("clean", base=base)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert result.returncode == 0, result.stderr
    assert os.path.isdir(live) and os.path.isdir(live_child) and os.path.isdir(other_namespace)
    assert not os.path.exists(dead)
    kept = re.search(r"kept (\d+) folder\(s\) of running owners", result.stdout)
    assert kept and int(kept.group(1)) == 2, result.stdout
    elsewhere = re.search(r"kept (\d+) folder\(s\) of other pid namespaces", result.stdout)
    assert elsewhere and int(elsewhere.group(1)) == 1, result.stdout


def test_doctor_flags_small_shm(base, small_tmpfs):
    result = run_cli("doctor", "--shm", small_tmpfs, base=base)
    assert result.returncode == 1, result.stdout
    assert "64.0 MiB" in result.stdout and "--shm-size=" in result.stdout
    assert "PROBLEM:" in result.stdout and "OK:" not in result.stdout


def test_doctor_and_clean_search_the_shm_option(base, small_tmpfs):
    leftover = make_folder(small_tmpfs, dead_owner(), nbytes=60 * MIB)
    result = run_cli("doctor", "--shm", small_tmpfs, "--need", "1K", base=base)
    assert result.returncode == 1
    assert "nearly full" not in result.stdout, "a too-small shm is reported as such, not as full"
    assert "owner dead" in result.stdout and f"clean --shm {small_tmpfs}" in result.stdout
    cleaned = run_cli("clean", "--shm", small_tmpfs, base=base)
    assert f"removed {leftover}" in cleaned.stdout and not os.path.exists(leftover)


def test_doctor_flags_missing_shm(base, tmp_path):
    result = run_cli("doctor", "--shm", str(tmp_path / "missing"), base=base)
    assert result.returncode == 1
    assert "does not exist" in result.stdout and "--shm-size=" in result.stdout


def test_bench_help_is_the_benchmark_parsers():
    result = run_cli("bench", "--help")
    assert result.returncode == 0 and "--workloads" in result.stdout, result


def test_usage_errors():
    assert run_cli().returncode == 2
    assert run_cli("clean", "--bogus").returncode == 2
