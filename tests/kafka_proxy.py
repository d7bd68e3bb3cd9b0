"""A TCP proxy in front of the real test broker that can answer a producer's first two
produce requests in the wrong order: the broker then sees the second before the first.

That is what happens, by timing, when a producer starts sending to a partition the
broker has only just created (or while it moves): its first ProduceRequest fails with a
retriable error (NOT_LEADER_OR_FOLLOWER) because the broker has not applied the
partition yet, its second, already in flight, arrives once it has. A broker with no state
for the producer id accepts any first sequence (KIP-360, until Kafka 4.5's KAFKA-15591),
so the second batch is written as the producer's first and the first one can never be
(OUT_OF_ORDER_SEQUENCE_NUMBER): the Monitor's first batches were lost that way on a
loaded machine (issue 28). Holding the first request back until the second arrives makes
the broker see them in that order every time.

Every client connection (the bootstrap one and those to the broker's advertised address)
must go through the proxy: Metadata responses are rewritten to advertise the proxy's
port instead of the broker's. Kafka's wire format: each request and response is a 4-byte
big-endian length and its bytes; a request starts with api_key, api_version and
correlation id, a response with the correlation id.
"""

from __future__ import annotations

import socket
import struct
import threading

PRODUCE, METADATA = 0, 3
_FLEXIBLE_METADATA = 9  # Metadata versions from 9 on use compact arrays and tagged fields


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket) -> bytes | None:
    head = _read_exactly(sock, 4)
    if head is None:
        return None
    body = _read_exactly(sock, struct.unpack(">i", head)[0])
    return None if body is None else head + body


def _shut(*sockets: socket.socket) -> None:
    """End both directions of a proxied connection (the other pump then ends too)."""
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _skip_tags(buf: bytes, pos: int) -> int:
    count, pos = _uvarint(buf, pos)
    for _ in range(count):
        _tag, pos = _uvarint(buf, pos)
        size, pos = _uvarint(buf, pos)
        pos += size
    return pos


def advertise_port(frame: bytes, version: int, port: int) -> bytes:
    """A Metadata response ``frame`` (length prefix included) with every broker's port
    replaced by ``port``: hosts keep their length, ports are fixed-width."""
    buf = bytearray(frame)
    flexible = version >= _FLEXIBLE_METADATA
    pos = 8  # length, correlation id
    if flexible:
        pos = _skip_tags(buf, pos)
    if version >= 3:
        pos += 4  # throttle_time_ms
    if flexible:
        count, pos = _uvarint(buf, pos)
        count -= 1
    else:
        count = struct.unpack_from(">i", buf, pos)[0]
        pos += 4
    for _ in range(count):
        pos += 4  # node_id
        if flexible:
            size, pos = _uvarint(buf, pos)
            pos += size - 1
        else:
            pos += 2 + struct.unpack_from(">h", buf, pos)[0]
        struct.pack_into(">i", buf, pos, port)
        pos += 4
        if version >= 1:  # rack, nullable
            if flexible:
                size, pos = _uvarint(buf, pos)
                pos += max(size - 1, 0)
            else:
                size = struct.unpack_from(">h", buf, pos)[0]
                pos += 2 + max(size, 0)
        if flexible:
            pos = _skip_tags(buf, pos)
    return bytes(buf)


class ReorderingProxy:
    """Listens on 127.0.0.1 (``bootstrap``: its address) and forwards to the broker at
    ``broker``. The first produce request it sees is held back until a second one arrives
    on its connection, which then goes first, or until ``release()``, when it goes alone."""

    def __init__(self, broker: str) -> None:
        host, _, port = broker.rpartition(":")
        self.broker = (host, int(port))
        self.holding = threading.Event()  # the first produce request is held back
        self.swapped = threading.Event()  # the broker got the second produce request before the first
        self._lock = threading.Lock()
        self._held = False
        self._release: list = []  # how to send the held request alone
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.bootstrap = f"127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = [self._server]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> bool:
        """Send the held request on its own (no second one came); True if one was held."""
        with self._lock:
            release = self._release[:]
        return bool(release) and release[0]()

    def close(self) -> None:
        self._closed = True
        for s in list(self._sockets):
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> ReorderingProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            broker = socket.create_connection(self.broker)
            self._sockets += [client, broker]
            requests: dict[int, tuple[int, int]] = {}  # correlation id -> (api key, version)
            send_lock = threading.Lock()
            threading.Thread(target=self._requests, args=(client, broker, requests, send_lock), daemon=True).start()
            threading.Thread(target=self._responses, args=(broker, client, requests), daemon=True).start()

    def _requests(self, client: socket.socket, broker: socket.socket, requests: dict, send_lock: threading.Lock) -> None:
        held: list[bytes] = []

        def send(*frames: bytes) -> None:
            with send_lock:
                for f in frames:
                    broker.sendall(f)

        def release_alone() -> bool:
            with self._lock:
                frames = held[:]
                held.clear()
            send(*frames)
            return bool(frames)

        try:
            while (frame := _read_frame(client)) is not None:
                api_key, version, corr = struct.unpack_from(">hhi", frame, 4)
                requests[corr] = (api_key, version)
                if api_key != PRODUCE:
                    send(frame)
                    continue
                with self._lock:
                    if not self._held:  # the first produce request: hold it
                        self._held = True
                        held.append(frame)
                        self._release.append(release_alone)
                        self.holding.set()
                        continue
                    first = held[:]
                    held.clear()
                if first:
                    self.swapped.set()
                send(frame, *first)
        except OSError:
            pass
        finally:
            _shut(client, broker)

    def _responses(self, broker: socket.socket, client: socket.socket, requests: dict) -> None:
        try:
            while (frame := _read_frame(broker)) is not None:
                corr = struct.unpack_from(">i", frame, 4)[0]
                api_key, version = requests.pop(corr, (-1, -1))
                if api_key == METADATA:
                    frame = advertise_port(frame, version, self.port)
                client.sendall(frame)
        except OSError:
            pass
        finally:
            _shut(client, broker)
