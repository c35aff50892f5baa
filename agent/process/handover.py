"""Handing a folder to a process that can reach neither it nor a /proc through its own root (a bare chroot:
haproxy's worker chroots into an empty /var/lib/haproxy), so that its dlopen can load the sampler by a path
relative to that folder.

On one thread of the process, stopped by heapscope, system calls made one at a time (agent.process.inject): a
Unix socket connected to an abstract address heapscope listens on (a name, not a file: nothing is written into
any filesystem, and only the process whose PID the kernel gives for the connection is answered), over which
heapscope sends a descriptor of the folder (SCM_RIGHTS); then that thread's filesystem context is made its own
(unshare(CLONE_FS): the program's other threads keep theirs, their root and working directory as they were), a
descriptor of its working directory kept, and the thread's working directory set to the folder. The dlopen runs;
leave() puts the working directory back and closes that descriptor. The chroot itself (the thread's root) is never
changed, so absolute paths resolve as before throughout. An abstract address belongs to a network namespace: a
process in another one is refused (preflight).
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Protocol

from agent.errors import TargetError

# x86_64 system call numbers and flags.
SYS_CLOSE, SYS_SOCKET, SYS_CONNECT, SYS_RECVMSG, SYS_FCHDIR, SYS_OPENAT, SYS_UNSHARE = 3, 41, 42, 47, 81, 257, 272
SOCK_CLOEXEC = 0o2000000
MSG_DONTWAIT, MSG_CMSG_CLOEXEC = 0x40, 0x40000000
CLONE_FS = 0x200
O_PATH, O_DIRECTORY, O_CLOEXEC = 0o10000000, 0o200000, 0o2000000
AT_FDCWD = -100

# Where each piece goes in the page the caller mapped in the process.
ADDRESS, DOT, BYTE, IOV, MSG, CONTROL = 0, 128, 136, 144, 160, 224
CONTROL_SIZE = 24  # CMSG_SPACE(sizeof(int))
PAGE_NEEDED = CONTROL + CONTROL_SIZE
ACCEPT_TIMEOUT = 2.0


class SyscallThread(Protocol):
    """A stopped thread of the process that makes system calls for heapscope (agent.process.inject)."""

    def call(self, nr: int, *args: int) -> int: ...  # the raw result: -errno as an unsigned word

    def write(self, address: int, data: bytes) -> None: ...

    def read(self, address: int, n: int) -> bytes: ...


def _checked(pid: int, result: int, what: str) -> int:
    if result >= (1 << 64) - 4095:
        raise TargetError(f"process {pid}: {what} for handing it the sampler's folder failed: "
                          f"{os.strerror((1 << 64) - result)}")
    return result


def same_network_namespace(pid: int, proc_root: str = "/proc") -> bool:
    """Whether `pid` can connect to an abstract Unix address heapscope binds (both in one network namespace)."""
    try:
        return os.stat(f"{proc_root}/{pid}/ns/net").st_ino == os.stat(f"{proc_root}/self/ns/net").st_ino
    except OSError:
        return False


def enter(thread: SyscallThread, pid: int, page: int, folder: str) -> int:
    """Make `folder` the working directory of `thread` alone (its filesystem context unshared first); returns the
    process's descriptor of the thread's working directory before, for leave(). `page`: PAGE_NEEDED bytes of the
    process's memory, writable, which the caller maps and unmaps."""
    name = b"\0heapscope-folder-" + os.urandom(8).hex().encode()
    address = struct.pack("<H", socket.AF_UNIX) + name
    thread.write(page + ADDRESS, address)
    thread.write(page + DOT, b".\0")
    opened: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as listener:
            listener.bind(name)
            listener.listen(1)
            listener.settimeout(ACCEPT_TIMEOUT)
            sock = _checked(pid, thread.call(SYS_SOCKET, socket.AF_UNIX, socket.SOCK_STREAM | SOCK_CLOEXEC, 0),
                            "socket")
            opened.append(sock)
            _checked(pid, thread.call(SYS_CONNECT, sock, page + ADDRESS, len(address)), "connect")
            _send_folder(listener, pid, folder)
        thread.write(page + IOV, struct.pack("<QQ", page + BYTE, 1))
        # struct msghdr: name, namelen, iov, iovlen, control, controllen, flags (56 bytes on x86_64)
        thread.write(page + MSG, struct.pack("<QI4xQQQQi4x", 0, 0, page + IOV, 1, page + CONTROL, CONTROL_SIZE, 0))
        _checked(pid, thread.call(SYS_RECVMSG, sock, page + MSG, MSG_DONTWAIT | MSG_CMSG_CLOEXEC), "recvmsg")
        length, level, kind, folder_fd = struct.unpack("<QiiI", thread.read(page + CONTROL, 20))
        if (length, level, kind) != (20, socket.SOL_SOCKET, socket.SCM_RIGHTS):
            raise TargetError(f"process {pid}: the sampler's folder did not arrive over its socket")
        opened.append(folder_fd)
        cwd = _checked(pid, thread.call(SYS_OPENAT, AT_FDCWD & 0xFFFFFFFFFFFFFFFF, page + DOT,
                                        O_PATH | O_DIRECTORY | O_CLOEXEC), "open of its working directory")
        try:
            _checked(pid, thread.call(SYS_UNSHARE, CLONE_FS), "unshare")
            _checked(pid, thread.call(SYS_FCHDIR, folder_fd), "fchdir")
        except BaseException:
            thread.call(SYS_CLOSE, cwd)
            raise
        return cwd
    finally:
        for fd in opened:
            thread.call(SYS_CLOSE, fd)


def _send_folder(listener: socket.socket, pid: int, folder: str) -> None:
    """Accept the process's connection (its PID as the kernel says it) and send it a descriptor of `folder`."""
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        raise TargetError(f"process {pid} did not connect for the sampler's folder") from None
    with conn:
        peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        if peer != pid:
            raise TargetError(f"process {peer}, not {pid}, connected for the sampler's folder")
        fd = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            conn.sendmsg([b"d"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
        finally:
            os.close(fd)


def leave(thread: SyscallThread, pid: int, cwd: int) -> None:
    """The thread's working directory put back (enter's `cwd`), and that descriptor closed."""
    try:
        _checked(pid, thread.call(SYS_FCHDIR, cwd), "fchdir back")
    finally:
        thread.call(SYS_CLOSE, cwd)
