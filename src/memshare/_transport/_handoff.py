"""Handing a worker's result memfds to the parent: descriptors passed over a Unix socket.

A worker's memfd must stay open until the parent holds its own reference to
it, and no longer; a dead parent, a dead worker or a lost message must leak
nothing. Descriptors passed with ``SCM_RIGHTS`` give exactly that:

* the parent's session listens on an :class:`Inbox`: a Unix socket file
  with a random name in the session's private 0700 folder, so that no other
  user can even connect to it (where no such folder can be made, an
  abstract-namespace socket instead: see below);
* a worker's task (``_handoff_worker``) connects (:func:`connect`) before
  it puts its first result in a memfd, without waiting: if the inbox cannot
  be reached at once (gone, its queue full), the task's results are named
  files instead. Once its results are written and before it returns its
  outcome, it sends their descriptors with their (device, inode) in small
  batches (:func:`send_on`), closing its own as it goes; a send that cannot
  finish within a bound leaves the rest to named files. A descriptor in
  flight belongs to the kernel, then to the parent's socket: if the parent
  dies, or closes the inbox unread, the kernel frees it. Because the
  descriptors are sent first, they are queued by the time the outcome
  arrives;
* the parent, restoring the outcome, takes each result's descriptor by its
  (device, inode) (:meth:`Inbox.take`), reading whatever is queued without
  ever waiting, maps it and closes it. Descriptors are counted per outcome:
  one worker's shared array returned by several tasks arrives once per
  task, and each outcome takes (or :meth:`Inbox.discard` closes) its own.
  A descriptor that arrived but was not claimed (a worker killed after
  sending, a call abandoned) is closed when its outcome is restored or when
  the session closes the inbox.

Both ends check each other: the parent accepts only connections whose
``SO_PEERCRED`` uid is its own (closing any other at once), and keeps a
received descriptor only when it is the (device, inode) the message
announced and a memshare memfd of a result or a shared array; the worker
sends only to a listener whose peer credentials are the parent's pid and uid.

What another local user can do: nothing to an inbox in a private folder
(``connect`` needs search permission on the folder). The abstract-namespace
fallback (used only when the session's folder cannot be created, say a
read-only ``/dev/shm`` and temp dir) is visible in ``/proc/net/unix`` and
open to anyone: another user can fill its queue of connections, which then
only makes results named files (or, with no room for those, pickled), never
a worker that waits; whatever such a user sends is closed unread.

The inbox holds a descriptor of its folder and is bound, and reached, through
it: its address is ``/proc/<parent pid>/fd/<that descriptor>/<name>``.
That path is short whatever the folder's (``sun_path`` holds at most 107
bytes), names the folder the parent made even if another file system is
later mounted over its path, and can be walked only by processes allowed to
read the parent's descriptors (its own user's: what memfds need anyway).
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import stat
import struct
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

from .. import _forksafe
from .._lifetime import _memfd, _procfs
from .._lifetime._folders import ensure_private_dir
from .._stats import logger

#: Descriptors per message: SCM_RIGHTS carries at most 253 (SCM_MAX_FD).
_FDS_PER_MESSAGE = 250
_IDENTITY = struct.Struct("=QQ")  # (device, inode) of each descriptor, in order
_CREDENTIALS = struct.Struct("=iII")  # struct ucred: pid, uid, gid
#: The memfd kinds a worker hands over: its result files and its shared arrays.
_HANDED_KINDS = ("result", "shared")
#: How the inbox's folder is held: a directory (never a symlink to one), for paths only.
_FOLDER_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
#: How long a worker's send may block (the parent reads only when it restores an outcome, and
#: the kernel queues a bounded amount per connection) before the rest of its results become named files.
SEND_TIMEOUT_SECONDS = 10.0

Identity = Tuple[int, int]


class Inbox:
    """The parent's end: a listening socket and the descriptors received on it, by (device, inode). Thread-safe.

    ``folder`` is a private folder of this process (created 0700 if
    missing) to put the socket in; with None, or when it cannot be made, the
    socket is in the abstract namespace (see the module docstring).
    """

    def __init__(self, folder: Optional[str] = None) -> None:
        self.owner = os.getpid()
        self._lock = _forksafe.lock()
        self._folder_fd = -1  # the inbox's folder, held for its life; -1: the abstract namespace
        self._name = ""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.address = self._bind(folder)
            self._listener.listen(socket.SOMAXCONN)
            self._listener.setblocking(False)
        except BaseException:
            _release(self._listener, [], {}, self._folder_fd, self._name, self.owner)
            raise
        # Mutated in place, never replaced: the finalizer closes what they hold
        # if the inbox is garbage-collected unclosed. Each identity maps to the
        # descriptors received for it, oldest first: one per outcome that returns it.
        self._connections: List[socket.socket] = []
        self._received: Dict[Identity, List[int]] = {}
        self._finalizer = weakref.finalize(
            self, _release, self._listener, self._connections, self._received, self._folder_fd, self._name, self.owner
        )
        _live.add(self)

    def _bind(self, folder: Optional[str]) -> str:
        """Bind the listener in ``folder`` through a descriptor of it (else in the abstract namespace); its address."""
        if folder is not None:
            try:
                ensure_private_dir(folder)
                self._folder_fd = os.open(folder, _FOLDER_FLAGS)
                info = os.fstat(self._folder_fd)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                    raise PermissionError(errno.EPERM, "not a private directory of this user", folder)
                self._name = f"inbox-{secrets.token_hex(8)}.sock"
                here = f"{_procfs.fd_path('self', self._folder_fd)}/{self._name}"
                self._listener.bind(here)
                os.chmod(here, 0o600)  # the folder is 0700 already: no window for another user
                return f"{_procfs.fd_path(self.owner, self._folder_fd)}/{self._name}"
            except OSError as exc:
                if self._folder_fd >= 0:
                    _unlink_socket(self._folder_fd, self._name)
                    os.close(self._folder_fd)
                    self._folder_fd, self._name = -1, ""
                logger.info(
                    "memshare: the result inbox is an abstract socket, which other local users can reach "
                    "(a worker then falls back to named result files, never waits): no socket in %s: %s",
                    folder,
                    exc,
                )
        address = f"\0memshare-{self.owner}-{secrets.token_hex(8)}"
        self._listener.bind(address)
        return address

    def take(self, identity: Identity) -> Optional[int]:
        """One descriptor received for ``identity`` (the caller closes it), or None if none came."""
        with self._lock:
            if identity not in self._received:
                self._drain()
            return self._pop(identity)

    def discard(self, identities: Sequence[Identity]) -> None:
        """Close one received descriptor for each entry of ``identities`` (an outcome's unclaimed ones).

        An outcome passes each identity it did not take, once: the
        descriptors queued for later outcomes of the same memfd stay.
        """
        if not identities:
            return  # the common case (no result memfds): no system call
        with self._lock:
            self._drain()
            for identity in identities:
                fd = self._pop(identity)
                if fd is not None:
                    os.close(fd)

    def held(self) -> int:
        """How many received descriptors wait to be taken, once whatever is queued has been read."""
        with self._lock:
            self._drain()
            return sum(len(fds) for fds in self._received.values())

    def close(self) -> None:
        """Stop listening and close everything received or queued; idempotent.

        Connections not accepted yet and messages not read yet go with the
        sockets: the kernel frees the descriptors they carry.
        """
        with self._lock:
            self._finalizer()
        _live.discard(self)

    # -- with the lock held ----------------------------------------------------

    def _pop(self, identity: Identity) -> Optional[int]:
        fds = self._received.get(identity)
        if not fds:
            return None
        fd = fds.pop(0)
        if not fds:
            del self._received[identity]
        return fd

    def _drain(self) -> None:
        """Accept every queued connection and read every queued message, never waiting."""
        if self._listener.fileno() < 0:
            return
        while True:
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # out of descriptors (EMFILE): read what is accepted, the rest next time
                logger.debug("memshare: the result inbox cannot accept a connection now: %s", exc)
                break
            _, uid, _ = _CREDENTIALS.unpack(
                connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
            )
            if uid != os.geteuid():
                connection.close()  # another user's process: whatever it sent goes with the socket
                continue
            connection.setblocking(False)
            self._connections.append(connection)
        for connection in list(self._connections):
            while True:
                try:
                    message, fds, _, _ = socket.recv_fds(
                        connection, _IDENTITY.size * _FDS_PER_MESSAGE, 253, socket.MSG_CMSG_CLOEXEC
                    )
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    message, fds = b"", []
                if not message and not fds:  # end of file: the worker sent everything and closed
                    connection.close()
                    self._connections.remove(connection)
                    break
                self._keep(message, fds)

    def _keep(self, message: bytes, fds: List[int]) -> None:
        announced = [_IDENTITY.unpack_from(message, i * _IDENTITY.size) for i in range(len(message) // _IDENTITY.size)]
        for index, fd in enumerate(fds):
            info = os.fstat(fd)
            identity = (info.st_dev, info.st_ino)
            wanted = index < len(announced) and announced[index] == identity
            if not wanted or _memfd.kind_of_descriptor(fd) not in _HANDED_KINDS:
                os.close(fd)
                continue
            self._received.setdefault(identity, []).append(fd)


def _release(
    listener: socket.socket,
    connections: List[socket.socket],
    received: Dict[Identity, List[int]],
    folder_fd: int,
    name: str,
    owner: int,
) -> None:
    """Close an inbox's sockets and the descriptors it received; its owner also removes the socket's name."""
    listener.close()
    if folder_fd >= 0:
        if os.getpid() == owner:
            _unlink_socket(folder_fd, name)  # a forked child closes its copies only: the name is the parent's
        os.close(folder_fd)
    for connection in connections:
        connection.close()
    connections.clear()
    for fds in received.values():
        for fd in fds:
            os.close(fd)
    received.clear()


def _unlink_socket(folder_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder_fd)
    except OSError:
        pass  # not bound yet, or gone with the folder already


def connect(address: str, owner: int) -> socket.socket:
    """A connection to the inbox at ``address`` of pid ``owner``, made without waiting.

    Raises OSError at once when the inbox is gone (the parent died or
    finished the call), its queue of connections is full
    (``BlockingIOError``), or it is not the parent's (``PermissionError``).
    Sends on the connection block at most :data:`SEND_TIMEOUT_SECONDS`.
    """
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.setblocking(False)  # a Unix socket's connect then fails with EAGAIN instead of waiting
        connection.connect(address)
        pid, uid, _ = _CREDENTIALS.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        )
        if pid != owner or uid != os.geteuid():
            raise PermissionError(
                errno.EPERM, f"memshare: the result inbox is held by pid {pid}, not by the parent {owner}"
            )
        connection.settimeout(SEND_TIMEOUT_SECONDS)
    except BaseException:
        connection.close()
        raise
    return connection


def send_on(connection: socket.socket, files: Sequence[Tuple[int, Identity]]) -> None:
    """Send the descriptors of ``files`` ((fd, (device, inode)) pairs) on a connection from :func:`connect`.

    Returns once they are queued in the parent's socket (the caller may then
    close its own). Raises OSError (``TimeoutError`` among them) when they
    could not all be queued; those of the messages that were are the parent's.
    """
    for start in range(0, len(files), _FDS_PER_MESSAGE):
        chunk = files[start : start + _FDS_PER_MESSAGE]
        payload = b"".join(_IDENTITY.pack(*identity) for _, identity in chunk)
        socket.send_fds(connection, [payload], [fd for fd, _ in chunk])


def send(address: str, owner: int, files: Sequence[Tuple[int, Identity]]) -> None:
    """:func:`connect` to the inbox at ``address`` of pid ``owner`` and :func:`send_on` ``files``."""
    with connect(address, owner) as connection:
        send_on(connection, files)


# The inboxes of this process, closed in a forked child: its copies of the
# listening sockets would keep connections queued after the parent closed its own.
_live: weakref.WeakSet[Inbox] = weakref.WeakSet()


def _close_inherited() -> None:
    for inbox in list(_live):
        inbox._lock = _forksafe.lock()
        inbox._finalizer()  # closes this process's copies only
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)
