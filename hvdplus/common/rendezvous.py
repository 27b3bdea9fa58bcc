"""The job's rendezvous: a key-value service that only admits processes holding the job's secret.

hvdplusrun starts a `RendezvousServer` bound to the address the workers reach it by (never 0.0.0.0)
and gives every worker the address, port and a random per-job secret through its environment.
torch.distributed's Gloo backend then exchanges its connection details through a `RendezvousClient`.

Wire protocol (stdlib only, version 1):
  handshake  server -> client  MAGIC + server nonce (32 bytes)
             client -> server  client nonce (32) + HMAC-SHA256(secret, "client" + nonces)
             server -> client  HMAC-SHA256(secret, "server" + nonces)    (mutual: both prove the secret)
  frames     length (4 bytes) + body + HMAC-SHA256(session key, direction + sequence number + body)
The session key is derived from the secret and both nonces, so frames cannot be forged, replayed or
reordered, and a connection that fails the handshake is closed before a single request is read.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = [
    "RendezvousServer",
    "RendezvousClient",
    "RendezvousTimeout",
    "new_secret",
    "publish_secret",
    "await_secret",
    "with_published_secret",
]

log = logging.getLogger("hvdplus.runner")

MAGIC = b"HVDPLUS-RDV-1\n"
NONCE = 32
MAC = 32
MAX_FRAME = 256 * 1024 * 1024
HANDSHAKE_SECONDS = 10.0
OK, TIMEOUT, ERROR = 0, 1, 2
OPS = ("set", "get", "add", "compare_set", "wait_keys", "check", "delete", "num_keys")


class RendezvousTimeout(TimeoutError):
    """Keys a worker waited for did not appear in time."""


def new_secret() -> str:
    """A fresh random per-job secret (hex text, 256 bits)."""
    return secrets.token_hex(32)


def publish_secret(path: str, secret: str) -> None:
    """Write `secret` to `path` readable by this user only (0600, in a 0700 directory it creates), atomically:
    a reader sees no file or the whole secret. Under plain srun, rank 0 shares the job's secret this way
    through a filesystem the job's nodes share."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret)
    os.replace(partial, path)


def await_secret(path: str, timeout: float) -> str:
    """The secret rank 0 published at `path`, waiting up to `timeout` seconds for the file."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as source:
                return source.read()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"rank 0's rendezvous secret {path} did not appear within {timeout:g} s. Under plain srun "
                    f"hvdplus shares the job's secret through a file: set HVDPLUS_SECRET_DIR to a directory "
                    f"that every node of the job sees (default ~/.hvdplus), or launch with hvdplusrun, or "
                    f"with srun --mpi=pmix for the MPI engine"
                ) from None
            time.sleep(0.05)


_Connected = TypeVar("_Connected")


def with_published_secret(path: str, connect: Callable[[str], _Connected], timeout: float) -> _Connected:
    """`connect(secret)` with the secret rank 0 published at `path`. A file left by an earlier job step of the same
    ids that died before removing it (a restarted Slurm numbers jobs from 1 again) may be read before rank 0
    replaces it: while the server rejects the secret, the file is read again, until `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        secret = await_secret(path, max(deadline - time.monotonic(), 0.0))
        try:
            return connect(secret)
        except PermissionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _pack(*fields: bytes) -> bytes:
    return struct.pack("!I", len(fields)) + b"".join(struct.pack("!I", len(f)) + f for f in fields)


def _unpack(data: bytes) -> list[bytes]:
    (count,), offset, fields = struct.unpack_from("!I", data), 4, []
    for _ in range(count):
        (size,) = struct.unpack_from("!I", data, offset)
        fields.append(data[offset + 4 : offset + 4 + size])
        offset += 4 + size
    if offset != len(data):
        raise ConnectionError("malformed rendezvous frame")
    return fields


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("rendezvous connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Channel:
    """Authenticated frames over one socket; each side numbers what it sends."""

    def __init__(self, sock: socket.socket, session_key: bytes, is_server: bool) -> None:
        self.sock, self._key = sock, session_key
        self._send_dir, self._recv_dir = (b"S", b"C") if is_server else (b"C", b"S")
        self._sent = self._received = 0

    def send(self, body: bytes) -> None:
        mac = _mac(self._key, self._send_dir, struct.pack("!Q", self._sent), body)
        self._sent += 1
        self.sock.sendall(struct.pack("!I", len(body)) + body + mac)

    def recv(self) -> bytes:
        (size,) = struct.unpack("!I", _recv_exact(self.sock, 4))
        if size > MAX_FRAME:
            raise ConnectionError(f"rendezvous frame of {size} bytes is over the {MAX_FRAME} byte limit")
        body, mac = _recv_exact(self.sock, size), _recv_exact(self.sock, MAC)
        expected = _mac(self._key, self._recv_dir, struct.pack("!Q", self._received), body)
        if not hmac.compare_digest(mac, expected):
            raise ConnectionError("rendezvous frame failed authentication")
        self._received += 1
        return body


def _server_handshake(sock: socket.socket, secret: bytes) -> _Channel:
    nonce_s = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + nonce_s)
    answer = _recv_exact(sock, NONCE + MAC)
    nonce_c, proof = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", nonce_s, nonce_c)):
        raise PermissionError("client did not prove the job secret")
    sock.sendall(_mac(secret, b"server", nonce_s, nonce_c))
    return _Channel(sock, _mac(secret, b"session", nonce_s, nonce_c), is_server=True)


def _client_handshake(sock: socket.socket, secret: bytes) -> _Channel:
    greeting = _recv_exact(sock, len(MAGIC) + NONCE)
    if not greeting.startswith(MAGIC):
        raise ConnectionError("the rendezvous address does not answer as an hvdplus rendezvous server")
    nonce_s, nonce_c = greeting[len(MAGIC) :], secrets.token_bytes(NONCE)
    sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
    try:
        proof = _recv_exact(sock, MAC)
    except ConnectionError:
        raise PermissionError(
            "the rendezvous server rejected this worker's secret (HVDPLUS_SECRET_KEY): "
            "start workers with hvdplusrun, which passes the job's secret"
        ) from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_s, nonce_c)):
        raise PermissionError("the rendezvous server failed to prove the job secret")
    return _Channel(sock, _mac(secret, b"session", nonce_s, nonce_c), is_server=False)


class _Store:
    """The key-value state, with waits for keys that are not there yet."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()

    def _wait(self, keys: list[bytes], timeout: float) -> bool:
        return self.cond.wait_for(lambda: all(k in self.data for k in keys), timeout)

    def apply(self, op: str, args: list[bytes]) -> tuple[int, list[bytes]]:
        """Run one request; wakes every waiter after a change."""
        with self.cond:
            result: tuple[int, list[bytes]] = getattr(self, f"_{op}")(*args)
            if op in ("set", "add", "compare_set", "delete"):
                self.cond.notify_all()
            return result

    def _set(self, key: bytes, value: bytes) -> tuple[int, list[bytes]]:
        self.data[key] = value
        return OK, []

    def _get(self, key: bytes, seconds: bytes) -> tuple[int, list[bytes]]:
        return (OK, [self.data[key]]) if self._wait([key], float(seconds)) else (TIMEOUT, [key])

    def _add(self, key: bytes, amount: bytes) -> tuple[int, list[bytes]]:
        self.data[key] = str(int(self.data.get(key, b"0")) + int(amount)).encode()
        return OK, [self.data[key]]

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> tuple[int, list[bytes]]:
        current = self.data.get(key)
        if current == expected or (current is None and expected == b""):
            self.data[key] = current = desired
        return OK, [expected if current is None else current]

    def _wait_keys(self, seconds: bytes, *keys: bytes) -> tuple[int, list[bytes]]:
        if self._wait(list(keys), float(seconds)):
            return OK, []
        return TIMEOUT, [k for k in keys if k not in self.data]

    def _check(self, *keys: bytes) -> tuple[int, list[bytes]]:
        return OK, [b"1" if all(k in self.data for k in keys) else b"0"]

    def _delete(self, key: bytes) -> tuple[int, list[bytes]]:
        return OK, [b"1" if self.data.pop(key, None) is not None else b"0"]

    def _num_keys(self) -> tuple[int, list[bytes]]:
        return OK, [str(len(self.data)).encode()]


class _Handler(socketserver.BaseRequestHandler):
    server: _Listener

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(HANDSHAKE_SECONDS)
        try:
            channel = _server_handshake(sock, self.server.secret)
        except OSError as exc:  # PermissionError (wrong secret) included
            log.warning("hvdplusrun: rendezvous rejected a connection from %s: %s", self.client_address[0], exc)
            return
        sock.settimeout(None)
        try:
            while True:
                op, *args = _unpack(channel.recv())
                status, fields = self.server.store.apply(OPS[op[0]], args)
                channel.send(_pack(bytes([status]), *fields))
        except (ConnectionError, OSError):
            return
        except (IndexError, ValueError, struct.error) as exc:
            log.warning("hvdplusrun: malformed rendezvous request from %s: %s", self.client_address[0], exc)


class _Listener(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: str, secret: bytes, store: _Store, port: int = 0) -> None:
        self.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.secret, self.store = secret, store
        super().__init__((address, port), _Handler)


class RendezvousServer:
    """Serves one shared key-value store on each given address (ephemeral ports) until `close()`."""

    def __init__(self, addresses: Iterable[str], secret: str, port: int = 0) -> None:
        """Listen on each address, at `port` (0: an ephemeral port each)."""
        self.store = _Store()
        self._secret = secret.encode()
        self._listeners = {
            addr: _Listener(addr, secret.encode(), self.store, port) for addr in dict.fromkeys(addresses)
        }
        self._threads = [
            threading.Thread(
                target=listener.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"hvdplus-rendezvous-{addr}",
                daemon=True,
            )
            for addr, listener in self._listeners.items()
        ]
        for thread in self._threads:
            thread.start()

    def listen(self, address: str) -> int:
        """Also serve the store on `address` (an elastic job's new host may reach the launcher there); its port."""
        if address not in self._listeners:
            listener = self._listeners[address] = _Listener(address, self._secret, self.store)
            thread = threading.Thread(
                target=listener.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"hvdplus-rendezvous-{address}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return self.port(address)

    def port(self, address: str) -> int:
        """The port this server listens on at `address`."""
        return self._listeners[address].server_address[1]

    def put(self, key: str, value: bytes) -> None:
        """Set a key from the launcher's side."""
        self.store.apply("set", [key.encode(), value])

    def get(self, key: str) -> bytes | None:
        """A key's value, or None when no worker set it."""
        with self.store.cond:
            return self.store.data.get(key.encode())

    def close(self) -> None:
        """Stop listening; connected workers see their connection close."""
        for listener in self._listeners.values():
            listener.shutdown()
            listener.server_close()


class RendezvousClient:
    """A worker's authenticated connection to the job's rendezvous server."""

    def __init__(self, address: str, port: int, secret: str, timeout: float) -> None:
        self.address, self.port, self._secret, self.timeout = address, port, secret, timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((address, port), timeout=min(timeout, HANDSHAKE_SECONDS))
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"cannot reach the rendezvous server at {address}:{port} within {timeout:g} s: {exc}"
                    ) from None
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._channel = _client_handshake(sock, secret.encode())
        sock.settimeout(None)
        self._lock = threading.Lock()

    def clone(self) -> RendezvousClient:
        """A second, independent connection to the same server."""
        return RendezvousClient(self.address, self.port, self._secret, self.timeout)

    def _call(self, op: str, *args: bytes) -> list[bytes]:
        with self._lock:
            self._channel.send(_pack(bytes([OPS.index(op)]), *args))
            status, *fields = _unpack(self._channel.recv())
        if status[0] == TIMEOUT:
            keys = ", ".join(f.decode(errors="replace") for f in fields)
            raise RendezvousTimeout(
                f"rendezvous: waited {self.timeout:g} s for key(s) {keys} that no worker set; "
                "are all workers running? (raise HVDPLUS_TIMEOUT / --start-timeout if slow)"
            )
        return fields

    def _seconds(self) -> bytes:
        return repr(self.timeout).encode()

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key.encode(), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of `key`, waiting for it to be set (up to `timeout` s, default the client's)."""
        seconds = self._seconds() if timeout is None else repr(timeout).encode()
        return self._call("get", key.encode(), seconds)[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key.encode(), str(amount).encode())[0])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", key.encode(), expected, desired)[0]

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        seconds = repr(self.timeout if timeout is None else timeout).encode()
        self._call("wait_keys", seconds, *(k.encode() for k in keys))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", *(k.encode() for k in keys))[0] == b"1"

    def delete(self, key: str) -> bool:
        return self._call("delete", key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call("num_keys")[0])

    def close(self) -> None:
        self._channel.sock.close()
