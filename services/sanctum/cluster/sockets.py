"""Private Unix sockets between the role processes: `UnixListener` makes one (HMAC-authenticated,
in a 0700 directory named after its process), and `sweep_stale_socket_dirs` removes the
directories of processes that died without cleaning up (SIGKILL, a killed Ray actor).
Used by the drafter channel (transport.py) and the verifier's event socket (events.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
from multiprocessing.connection import Listener

log = logging.getLogger("sanctum.transport")

SOCKET_DIR_PREFIX = "snc-"


def _socket_dir_pid(name: str) -> int | None:
    """The pid in a socket directory's name ("snc-<pid>-<random>"), or None."""
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == SOCKET_DIR_PREFIX[:-1] and parts[1].isdigit():
        return int(parts[1])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_socket_dirs(root: str | None = None) -> int:
    """Remove this user's socket directories whose process is gone (killed: nothing ran its
    cleanup); returns how many. Directories of live processes, or of other users, stay."""
    import shutil
    import tempfile

    root = root or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        pid = _socket_dir_pid(name)
        path = os.path.join(root, name)
        if pid is None or _alive(pid):
            continue
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    if removed:
        log.info("removed %d stale socket directories from %s", removed, root)
    return removed


class UnixListener:
    """Accepts authenticated connections (HMAC `authkey`) on a fresh Unix socket in a private
    temporary directory (0700, named after this process: `snc-<pid>-<random>`), and hands each to
    `on_connection(conn)` from its own thread. The directory goes at `close` or at exit; one left
    by a killed process is swept by the next `sweep_stale_socket_dirs`."""

    def __init__(self, on_connection, what: str):
        import atexit
        import tempfile

        self.on_connection, self.what = on_connection, what
        self.authkey = secrets.token_bytes(32)
        # short path: Unix socket paths are limited to ~104 bytes on macOS
        self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        self.address = os.path.join(self._dir, "s.sock")
        self.listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        os.chmod(self.address, 0o600)
        self._closing = False
        atexit.register(self.close)
        self._thread = threading.Thread(target=self._accept_loop, name=f"snc-{what}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn = self.listener.accept()
            except OSError:
                return  # listener closed
            except Exception as exc:
                if not self._closing:
                    log.warning("%s: rejected a connection (%s)", self.what, exc.__class__.__name__)
                continue
            if self._closing:
                conn.close()
                return
            self.on_connection(conn)

    def close(self) -> None:
        """Stop accepting: the accept thread is woken and joined before the socket closes.
        (On Linux, closing a socket does not wake a thread blocked in accept() on it: that
        thread would outlive the listener, holding the old file, for the life of the process.)"""
        if self._closing:
            return
        self._closing = True
        if self._thread is not threading.current_thread():
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
                wake.connect(self.address)  # fails its handshake: accept() returns at once
            self._thread.join(5)
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)
