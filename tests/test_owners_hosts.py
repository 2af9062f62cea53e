"""Folders on a temp folder shared between machines: the owner's host is part of its identity.

A dead owner is recognised by its pid, start time and pid namespace. The
initial pid namespace has the same inode on every Linux host, so on storage
shared by several machines (NFS or Lustre scratch, ``JOBLIB_TEMP_FOLDER`` on
a cluster) a live owner on another host looked dead here and its folder was
deleted under it. Folder names now record a host identity, another host's
owner is never judged dead, and the automatic sweep leaves network file
systems alone.

The end-to-end tests plant folders in a pytest tmp dir and run memshare in
fresh processes (the sweep runs once per process, on its first folder).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap

import pytest
from conftest import without_location_settings

from memshare._lifetime import _procfs
from memshare._lifetime._location import is_network_fstype, mount_fstype
from memshare._lifetime._owners import Owner, host_identity, new_folder_name, parse_folder_name, pid_namespace
from memshare._lifetime._sweep import sweep_dead_owners
from memshare._tools import cli as _cli

# Version-independent (folder ownership across hosts and pid namespaces: the kernel and memshare alone): run in CI's
# whole-suite environment (main) only.
pytestmark = pytest.mark.version_independent

#: The inode of the initial pid namespace, the same on every Linux host.
INITIAL_PID_NAMESPACE = 4026531836


def other_host() -> str:
    """A host identity that is not this host's."""
    host = "0123456789"
    return host if host != host_identity() else "9876543210"


def exited_pid() -> int:
    """The pid of a process that has exited and been reaped (not reused so soon)."""
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    return child.pid


def plant(base, name: str) -> str:
    path = os.path.join(str(base), name)
    os.mkdir(path, 0o700)
    with open(os.path.join(path, "dump-0123456789abcdef.bin"), "wb") as data:
        data.write(b"\1" * 4096)
    return path


def old_format_name(pid: int, start: int, namespace: int) -> str:
    """A folder name as memshare wrote it before folder names recorded a host."""
    return f"memshare-{pid}-{start}-{namespace}-{secrets.token_hex(8)}"


def run_python(code: str) -> subprocess.CompletedProcess:
    env = without_location_settings()
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def run_parallel_call(temp_folder) -> None:
    """One ``memshare.Parallel`` call in a fresh process, with its files in ``temp_folder``."""
    result = run_python(
        f"""
        import numpy as np
        import memshare
        out = memshare.Parallel(n_jobs=2, temp_folder={str(temp_folder)!r})(
            memshare.delayed(np.sum)(np.ones(1 << 18)) for _ in range(2)
        )
        assert out == [float(1 << 18)] * 2, out
        """
    )
    assert result.returncode == 0, result.stderr


def run_clean(bases, *args: str) -> subprocess.CompletedProcess:
    """``python -m memshare clean *args`` that sees only the test's folders (``bases``: ``private_bases``)."""
    return subprocess.run(bases.command("clean", *args), env=bases.env(), capture_output=True, text=True, timeout=60)


# The host identity and the name format.


def test_the_host_identity_is_short_stable_and_recorded_in_names():
    host = host_identity()
    assert len(host) == 10 and int(host, 16) >= 0
    assert host_identity() == host
    me = Owner.current()
    assert me.host == host
    name = new_folder_name(me)
    assert host in name and len(name) <= 80
    assert parse_folder_name(name) == me
    assert parse_folder_name(name + "-disk") == me
    assert new_folder_name(me) != name  # the random part


def test_names_of_older_versions_parse_without_a_host():
    owner = parse_folder_name(old_format_name(4242, 777, INITIAL_PID_NAMESPACE))
    assert owner == Owner(4242, 777, INITIAL_PID_NAMESPACE, None)
    assert parse_folder_name("memshare-4242-777-4026531836-0123456789-xyz") is None


def test_an_owner_on_another_host_is_never_judged_dead():
    dead_pid = exited_pid()
    here = Owner(dead_pid, 12345, pid_namespace(), host_identity())
    elsewhere = Owner(dead_pid, 12345, pid_namespace(), other_host())
    assert not here.is_alive(local=True) and not here.is_alive(local=False)
    assert elsewhere.is_alive(local=True) and elsewhere.is_alive(local=False)


def test_an_owner_without_a_host_is_judged_only_on_a_local_file_system():
    old = Owner(exited_pid(), 12345, pid_namespace(), None)
    assert not old.is_alive(local=True)
    assert old.is_alive(local=False)


# End to end: a call, and `python -m memshare clean`.


@pytest.fixture
def shared(tmp_path):
    """A temp folder, as on a scratch file system several machines share."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    return folder


def test_a_call_keeps_another_hosts_folder_and_removes_this_hosts_dead_ones(shared):
    other = plant(shared, new_folder_name(Owner(4242, 777, INITIAL_PID_NAMESPACE, other_host())))
    other_twin = plant(shared, new_folder_name(Owner(4242, 777, INITIAL_PID_NAMESPACE, other_host())) + "-disk")
    dead_here = plant(shared, new_folder_name(Owner(exited_pid(), 777, pid_namespace(), host_identity())))
    dead_twin = plant(shared, new_folder_name(Owner(exited_pid(), 777, pid_namespace(), host_identity())) + "-disk")
    run_parallel_call(shared)
    assert os.path.isdir(other) and os.path.isdir(other_twin), "a live owner's folder on another host was deleted"
    assert not os.path.exists(dead_here) and not os.path.exists(dead_twin), "leftovers of this host were kept"
    assert sorted(os.listdir(shared)) == sorted(os.path.basename(p) for p in (other, other_twin))


def test_clean_keeps_another_hosts_folder_and_removes_this_hosts_dead_ones(shared, private_bases):
    other = plant(shared, new_folder_name(Owner(4242, 777, INITIAL_PID_NAMESPACE, other_host())))
    dead_here = plant(shared, new_folder_name(Owner(exited_pid(), 777, pid_namespace(), host_identity())))
    result = run_clean(private_bases, "--shm", str(shared))
    assert result.returncode == 0, result.stdout + result.stderr
    assert os.path.isdir(other), "clean deleted a live owner's folder on another host"
    assert not os.path.exists(dead_here)
    assert f"removed {dead_here}" in result.stdout
    assert "1 folder(s) of other hosts" in result.stdout, result.stdout


def test_folders_of_older_versions_are_still_cleaned_on_a_local_file_system(shared, private_bases):
    old_dead = plant(shared, old_format_name(exited_pid(), 777, pid_namespace()))
    old_live = plant(shared, old_format_name(os.getpid(), Owner.current().start, pid_namespace()))
    run_parallel_call(shared)
    assert not os.path.exists(old_dead) and os.path.isdir(old_live)
    old_dead = plant(shared, old_format_name(exited_pid(), 777, pid_namespace()))
    result = run_clean(private_bases, "--shm", str(shared))
    assert result.returncode == 0, result.stderr
    assert not os.path.exists(old_dead) and os.path.isdir(old_live)


# Network file systems: detected from the mount table, left alone unless asked.

MOUNTINFO = textwrap.dedent(
    r"""
    22 27 0:21 / /proc rw,relatime - proc proc rw
    25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683652k
    27 1 252:1 / / rw,relatime - ext4 /dev/vda rw
    40 27 0:50 / /scratch rw,relatime - nfs4 filer:/export/scratch rw,vers=4.2
    41 40 0:51 / /scratch/node-local rw,relatime - tmpfs tmpfs rw
    42 27 0:52 / /lus rw - lustre 10.0.0.1@tcp:/fs rw
    43 27 0:53 / /home/me/remote\040dir rw - fuse.sshfs me@host:/ rw
    44 27 0:54 / /mnt/cifs rw - cifs //server/share rw
    45 27 0:55 / /mnt/over rw - fuse.fuse-overlayfs fuse-overlayfs rw
    46 27 0:56 / /mnt/cifs rw - tmpfs tmpfs rw
    """
).strip()


@pytest.mark.parametrize(
    "path, fstype",
    [
        ("/dev/shm/memshare-x", "tmpfs"),
        ("/tmp", "ext4"),
        ("/", "ext4"),
        ("/scratch", "nfs4"),
        ("/scratch/jobs/tmp", "nfs4"),
        ("/scratch/node-local/tmp", "tmpfs"),  # a mount inside a mount: the innermost counts
        ("/scratchpad", "ext4"),  # a prefix of the name is not a parent folder
        ("/lus/tmp", "lustre"),
        ("/home/me/remote dir/tmp", "fuse.sshfs"),  # mount points escape spaces as \040
        ("/mnt/cifs/x", "tmpfs"),  # mounted over: the later mount hides the earlier one
    ],
)
def test_the_file_system_of_a_path_is_read_from_the_mount_table(path, fstype):
    assert mount_fstype(path, MOUNTINFO) == fstype


def test_an_unreadable_mount_table_names_no_file_system():
    assert mount_fstype("/tmp", "") is None
    assert mount_fstype("/tmp", "garbage line\n") is None


@pytest.mark.parametrize(
    "fstype, network",
    [
        ("nfs", True),
        ("nfs4", True),
        ("lustre", True),
        ("cifs", True),
        ("smb3", True),
        ("gpfs", True),
        ("beegfs", True),
        ("ceph", True),
        ("fuse.sshfs", True),
        ("fuse.glusterfs", True),
        ("tmpfs", False),
        ("ext4", False),
        ("xfs", False),
        ("overlay", False),
        ("fuse.fuse-overlayfs", False),
        ("fuseblk", False),
        (None, False),
    ],
)
def test_network_file_system_types(fstype, network):
    assert is_network_fstype(fstype) is network


def fake_network_mount(monkeypatch, path) -> None:
    """Make memshare read a mount table in which ``path`` is an NFS mount."""
    table = MOUNTINFO + f"\n99 27 0:99 / {os.path.realpath(str(path))} rw - nfs4 filer:/export rw"
    monkeypatch.setattr(_procfs, "mountinfo", lambda: table)


def test_the_sweep_leaves_network_file_systems_alone_unless_asked(shared, monkeypatch):
    dead_here = plant(shared, new_folder_name(Owner(exited_pid(), 777, pid_namespace(), host_identity())))
    other = plant(shared, new_folder_name(Owner(4242, 777, INITIAL_PID_NAMESPACE, other_host())))
    old_dead = plant(shared, old_format_name(exited_pid(), 777, pid_namespace()))
    fake_network_mount(monkeypatch, shared)
    assert sweep_dead_owners({str(shared)}) == []
    assert os.path.isdir(dead_here) and os.path.isdir(other) and os.path.isdir(old_dead)
    removed = [path for path, _ in sweep_dead_owners({str(shared)}, network=True)]
    # Asked to sweep: only this host's dead owners go; a name without a host
    # cannot be judged on storage that other machines write to.
    assert removed == [dead_here]
    assert os.path.isdir(other) and os.path.isdir(old_dead)


def test_clean_says_it_left_a_network_file_system_alone_and_sweeps_it_when_asked(
    shared, monkeypatch, capsys, private_bases
):
    dead_here = plant(shared, new_folder_name(Owner(exited_pid(), 777, pid_namespace(), host_identity())))
    other = plant(shared, new_folder_name(Owner(4242, 777, INITIAL_PID_NAMESPACE, other_host())))
    fake_network_mount(monkeypatch, shared)
    assert _cli.clean(shm=str(shared)) == 0
    out = capsys.readouterr().out
    assert f"not swept: {shared} is on a network file system (nfs4)" in out and "--network-fs" in out
    assert "kept 1 folder(s) of dead owners on network file systems" in out, out
    assert os.path.isdir(dead_here) and os.path.isdir(other)
    assert _cli.clean(shm=str(shared), network_fs=True) == 0
    out = capsys.readouterr().out
    assert f"removed {dead_here}" in out and "not swept" not in out
    assert not os.path.exists(dead_here) and os.path.isdir(other)
    assert "kept 1 folder(s) of other hosts" in out, out
