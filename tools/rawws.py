"""A minimal RFC 6455 websocket client on a plain socket, for fault and fuzz tools.

Ordinary clients only send well-formed messages; this one sends whatever it is told: partial
frames, frames cut off mid-payload, reserved opcodes, unmasked frames, and it can stop reading
(a stalled client) or drop the connection at any byte. Loopback use only.

    c = RawClient.connect("127.0.0.1", 8000, "/v1/stream")
    c.send_text('{"sample_rate": 16000}')
    c.send_frame(OP_BINARY, payload[:100], fin=True, cut=50)   # stop after 50 bytes of the frame
    c.abort()                                                   # RST, no close handshake
"""
from __future__ import annotations

import base64
import os
import socket
import struct

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


class HandshakeError(Exception):
    """The server answered the upgrade request with something other than 101."""

    def __init__(self, status: int, head: bytes):
        super().__init__(f"websocket upgrade refused with HTTP {status}")
        self.status, self.head = status, head


def encode_frame(opcode: int, payload: bytes, fin: bool = True, mask: bool = True, rsv: int = 0) -> bytes:
    """One frame as a client sends it (masked unless `mask` is False)."""
    head = bytes([(0x80 if fin else 0) | (rsv & 0x7) << 4 | (opcode & 0xF)])
    n = len(payload)
    bit = 0x80 if mask else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 1 << 16:
        head += bytes([bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([bit | 127]) + struct.pack("!Q", n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + _mask(payload, key)


def _mask(payload: bytes, key: bytes) -> bytes:
    if not payload:
        return b""
    k = (key * (len(payload) // 4 + 1))[: len(payload)]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(k, "big")).to_bytes(len(payload), "big")


class RawClient:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""

    @classmethod
    def connect(cls, host: str, port: int, path: str = "/v1/stream", headers: dict | None = None,
                timeout: float = 10.0, rcvbuf: int | None = None) -> RawClient:
        """Open a connection and complete the upgrade. `rcvbuf` shrinks the socket's receive
        buffer (a slow reader fills it sooner)."""
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("RawClient is for loopback servers only")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(timeout)
        sock.connect((host, port))
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        client = cls(sock)
        head = client._read_until(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 101:
            sock.close()
            raise HandshakeError(status, head)
        return client

    # ------------------------------------------------------------------ sending
    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_frame(self, opcode: int, payload: bytes, fin: bool = True, mask: bool = True, rsv: int = 0,
                   cut: int | None = None) -> None:
        """Send one frame; with `cut`, only its first `cut` bytes (a frame cut off mid-way)."""
        data = encode_frame(opcode, payload, fin, mask, rsv)
        self.sock.sendall(data if cut is None else data[:cut])

    def send_text(self, text: str) -> None:
        self.send_frame(OP_TEXT, text.encode())

    def send_binary(self, data: bytes) -> None:
        self.send_frame(OP_BINARY, data)

    def send_close(self, code: int = 1000, reason: str = "") -> None:
        self.send_frame(OP_CLOSE, struct.pack("!H", code) + reason.encode())

    # ------------------------------------------------------------------ receiving
    def recv_frame(self) -> tuple[int, bytes]:
        """The next frame from the server (unmasked): (opcode, payload)."""
        b0, b1 = self._read_exact(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._read_exact(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._read_exact(8))[0]
        return b0 & 0x0F, self._read_exact(n)

    def recv_until_close(self, limit: int = 100_000) -> tuple[list[tuple[int, bytes]], int | None]:
        """Frames until the server's close frame (or the connection ends): (frames, close code)."""
        frames = []
        try:
            for _ in range(limit):
                op, payload = self.recv_frame()
                if op == OP_CLOSE:
                    return frames, struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                frames.append((op, payload))
        except (TimeoutError, ConnectionError, EOFError):
            pass
        return frames, None

    def _read_exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buffer)))
            if not chunk:
                raise EOFError("connection closed by the server")
            self.buffer += chunk
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("connection closed during the handshake")
            self.buffer += chunk
        head, self.buffer = self.buffer.split(marker, 1)
        return head

    # ------------------------------------------------------------------ ending
    def abort(self) -> None:
        """Drop the connection at once (TCP RST), whatever is half sent."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.sock.close()

    def close(self) -> None:
        self.sock.close()
