"""The step server's connections: the listening Unix socket, each new connection's handshake (its
own thread), and the front-ends that passed it, read by the round loop through one selector."""
from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable

from enhancer.errors import EnhancerError

from . import auth, wire

log = logging.getLogger("tim_enhancer.stepserver")
POLL_S = 0.05  # the accepting thread wakes at least this often (stop)
HANDSHAKE_S = 3.0  # a connection that has not proved the key this long after it opened is dropped
MAX_HANDSHAKES = 32  # handshakes under way at once; a connection beyond is closed at once
SEND_S = 5.0  # a reply a front-end does not take in this long: the front-end is dropped


class Front:
    """One connected front-end: its socket (non-blocking), the frames arriving on it, its lanes."""

    def __init__(self, sock: socket.socket):
        self.sock, self.reader, self.lanes = sock, wire.Reader(sock), set()


class Fronts:
    """The front-ends of a step server at `address` (a Unix socket path, mode 0600) that prove
    `key`. `read` and `reply` are the round loop's (one thread); `on_drop(front)` is called on that
    thread for each front-end dropped (closed, malformed, or a reply it did not take)."""

    def __init__(self, address: str, key: bytes, on_drop: Callable[[Front], None]):
        self.address, self._key, self._on_drop = str(address), key, on_drop
        if os.path.lexists(self.address):  # a socket left by a process that died
            if not stat.S_ISSOCK(os.lstat(self.address).st_mode):
                raise EnhancerError(f"{self.address} exists and is not a socket")
            os.unlink(self.address)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        os.chmod(self.address, 0o600)  # this user's processes only (the front-ends run as the same user)
        self._inode = os.stat(self.address).st_ino
        self.listener.listen(128)
        self.listener.settimeout(POLL_S)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._new: list[Front] = []  # front-ends that passed the handshake, for the round loop to take
        self._lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.live: set[Front] = set()
        self._stopping = self._closed = False
        threading.Thread(target=self._accept, name="step-server-accept", daemon=True).start()

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, front) -> bool:
        return front in self.live

    def _accept(self) -> None:
        try:
            while not self._stopping:
                try:
                    sock, _ = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError as e:
                    log.warning("accepting a connection failed: %s", e)
                    time.sleep(POLL_S)
                    continue
                if not self._handshakes.acquire(blocking=False):
                    log.warning("%d handshakes under way: a new connection closed", MAX_HANDSHAKES)
                    sock.close()
                    continue
                threading.Thread(target=self._admit, args=(sock,), name="step-server-handshake", daemon=True).start()
        finally:
            self.listener.close()

    def _admit(self, sock: socket.socket) -> None:
        """The handshake of a new connection; a front-end that proves the key joins the rounds."""
        try:
            sock.settimeout(HANDSHAKE_S)
            auth.challenge(sock, self._key, HANDSHAKE_S)
            sock.setblocking(False)
        except auth.KeyRefused as e:
            log.warning("refused a connection: %s", e)
            sock.close()
            return
        except TimeoutError:
            log.warning("dropped a connection that did not complete the handshake in %g s", HANDSHAKE_S)
            sock.close()
            return
        except (OSError, wire.ProtocolError) as e:
            log.warning("dropped a connection in its handshake: %s: %s", type(e).__name__, e)
            sock.close()
            return
        finally:
            self._handshakes.release()
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._new.append(Front(sock))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the loop is awake anyway) or closed
            pass

    def stop(self) -> None:
        """Refuse new connections from now on, and wake the round loop."""
        self._stopping = True
        try:
            if os.stat(self.address).st_ino == self._inode:
                os.unlink(self.address)
        except OSError:
            pass
        self._wake()

    def drop(self, front: Front) -> None:
        if front not in self.live:
            return
        self.live.discard(front)
        try:
            self._selector.unregister(front.sock)
        except (KeyError, ValueError):
            pass
        try:
            self._on_drop(front)
        finally:
            try:
                front.sock.close()
            except OSError:
                pass

    def read(self, timeout: float) -> list[tuple[Front, wire.Message]]:
        """The requests that arrive within `timeout` (the front-ends that closed or sent a malformed
        frame or request are dropped)."""
        with self._lock:
            new, self._new = self._new, []
        for front in new:
            self.live.add(front)
            self._selector.register(front.sock, selectors.EVENT_READ, front)
        got = []
        for sel_key, _ in self._selector.select(timeout):
            front = sel_key.data
            if front is None:  # woken: new front-ends, or stop
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            try:
                for msg in front.reader.feed():
                    wire.check_request(msg)
                    got.append((front, msg))
            except wire.ProtocolError as e:
                log.warning("dropped a front-end that sent a malformed message: %s", e)
                self.drop(front)
            except OSError:
                self.drop(front)
        return [(f, m) for f, m in got if f in self.live]

    def reply(self, front: Front, msg: wire.Message) -> None:
        """Send `msg` to `front` (dropped if it does not take it within SEND_S)."""
        if front not in self.live:
            return
        try:
            wire.send(front.sock, msg, SEND_S)
        except (OSError, wire.ProtocolError) as e:
            if not isinstance(e, ConnectionError):
                log.warning("dropped a front-end: a %s reply failed (%s: %s)", wire.KINDS[msg.kind],
                            type(e).__name__, e)
            self.drop(front)

    def close(self) -> None:
        """Drop every front-end (they see their connections end) and refuse those still in a handshake."""
        self.stop()
        with self._lock:
            self._closed = True
            new, self._new = self._new, []
        for front in new:
            self.live.add(front)
        for front in list(self.live):
            self.drop(front)
        self._selector.close()
        for s in (self._wake_r, self._wake_w):
            s.close()
