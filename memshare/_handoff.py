"""Handing a worker's result memfds to the parent: descriptors passed over a Unix socket.

A worker's memfd must stay open until the parent holds its own reference to
it, and no longer; a dead parent, a dead worker or a lost message must leak
nothing. Descriptors passed with ``SCM_RIGHTS`` give exactly that:

* the parent's session listens on an :class:`Inbox`, an abstract-namespace
  Unix socket with a random name (no file, nothing to clean up);
* a worker, once its results are written and before it returns its
  outcome, connects and sends their descriptors with their (device, inode)
  (:func:`send`), then closes its own at once. A descriptor in flight
  belongs to the kernel, then to the parent's socket: if the parent dies,
  or closes the inbox unread, the kernel frees it. Because the descriptors
  are sent first, they are queued by the time the outcome arrives;
* the parent, restoring the outcome, takes each result's descriptor by its
  (device, inode) (:meth:`Inbox.take`), reading whatever is queued without
  ever waiting, maps it and closes it. A descriptor that arrived but was
  not claimed (a worker killed after sending, a call abandoned) is closed
  when the outcome is restored or when the session closes the inbox.

Both ends check each other: the parent accepts only connections whose
``SO_PEERCRED`` uid is its own, and keeps a received descriptor only when it
is the (device, inode) the message announced and a memshare memfd of a
result or a shared array; the worker sends only to a listener whose peer
credentials are the parent's pid and uid.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

from . import _forksafe, _memfd

#: Descriptors per message: SCM_RIGHTS carries at most 253 (SCM_MAX_FD).
_FDS_PER_MESSAGE = 250
_IDENTITY = struct.Struct("=QQ")  # (device, inode) of each descriptor, in order
_CREDENTIALS = struct.Struct("=iII")  # struct ucred: pid, uid, gid
#: The memfd kinds a worker hands over: its result files and its shared arrays.
_HANDED_KINDS = ("result", "shared")

Identity = Tuple[int, int]


class Inbox:
    """The parent's end: a listening socket and the descriptors received on it, by (device, inode). Thread-safe."""

    def __init__(self) -> None:
        self.address = f"\0memshare-{os.getpid()}-{secrets.token_hex(8)}"
        self.owner = os.getpid()
        self._lock = _forksafe.lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._listener.bind(self.address)
            self._listener.listen(socket.SOMAXCONN)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        # Mutated in place, never replaced: the finalizer closes what they hold
        # if the inbox is garbage-collected unclosed.
        self._connections: List[socket.socket] = []
        self._received: Dict[Identity, int] = {}
        self._finalizer = weakref.finalize(self, _release, self._listener, self._connections, self._received)
        _live.add(self)

    def take(self, identity: Identity) -> Optional[int]:
        """The descriptor received for ``identity`` (the caller closes it), or None if none came."""
        with self._lock:
            if identity not in self._received:
                self._drain()
            return self._received.pop(identity, None)

    def discard(self, identities: Sequence[Identity]) -> None:
        """Close the descriptors received for ``identities`` that nobody took."""
        with self._lock:
            self._drain()
            for identity in identities:
                fd = self._received.pop(identity, None)
                if fd is not None:
                    os.close(fd)

    def held(self) -> int:
        """How many received descriptors wait to be taken."""
        with self._lock:
            return len(self._received)

    def close(self) -> None:
        """Stop listening and close everything received or queued; idempotent.

        Connections not accepted yet and messages not read yet go with the
        sockets: the kernel frees the descriptors they carry.
        """
        with self._lock:
            self._finalizer()
        _live.discard(self)

    # -- with the lock held ----------------------------------------------------

    def _drain(self) -> None:
        """Accept every queued connection and read every queued message, never waiting."""
        if self._listener.fileno() < 0:
            return
        while True:
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
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
            previous = self._received.pop(identity, None)
            if previous is not None:
                os.close(previous)
            self._received[identity] = fd


def _release(listener: socket.socket, connections: List[socket.socket], received: Dict[Identity, int]) -> None:
    """Close an inbox's sockets and the descriptors it received."""
    listener.close()
    for connection in connections:
        connection.close()
    connections.clear()
    for fd in received.values():
        os.close(fd)
    received.clear()


def send(address: str, owner: int, files: Sequence[Tuple[int, Identity]]) -> None:
    """Send the descriptors of ``files`` ((fd, (device, inode)) pairs) to the inbox at ``address`` of pid ``owner``.

    Returns once they are queued in the parent's socket (the caller may then
    close its own). Raises OSError when the inbox is gone (the parent died or
    finished the call) or is not the parent's.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.connect(address)
        pid, uid, _ = _CREDENTIALS.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        )
        if pid != owner or uid != os.geteuid():
            raise PermissionError(f"memshare: the result inbox is held by pid {pid}, not by the parent {owner}")
        for start in range(0, len(files), _FDS_PER_MESSAGE):
            chunk = files[start : start + _FDS_PER_MESSAGE]
            payload = b"".join(_IDENTITY.pack(*identity) for _, identity in chunk)
            socket.send_fds(connection, [payload], [fd for fd, _ in chunk])


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
