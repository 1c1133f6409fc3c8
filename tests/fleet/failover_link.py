"""The replication link of the failover tests: a TCP relay with latency, that can be cut.

On one machine a standby streams its primary's WAL over loopback within a
fraction of a millisecond: the window that an asynchronous failover loses
would be too small to see, and a test of it would depend on luck. Between
two data centres (or zones) the link has a latency of its own.
``LaggingLink`` stands for that link: the standby's ``primary_conninfo``
names the relay's port instead of the primary's; every chunk of bytes, in
both directions, is handed on ``delay`` seconds after it was read. So WAL
reaches the standby ``delay`` late, and its flush confirmation (what a
synchronous commit waits for) comes back ``delay`` later again.

``cut()`` is the primary's zone going dark: the listening socket and every
connection close at once and whatever was still in transit is dropped,
never delivered, as packets on a link that is gone. It is what leaves an
asynchronous standby without the last ``delay`` seconds of the primary's
commits (and everything the primary commits after the cut, until it is
stopped).

Pausing the standby's *replay* (``Standby.pause_replay()``) would not do:
a standby that has received and flushed WAL replays all of it before a
promotion completes, so replay lag loses nothing at failover; only WAL the
standby never received is lost. (``test_failover.py`` shows both.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from types import TracebackType

from tests.live.server import free_port

__all__ = ["LaggingLink"]

CHUNK = 65536


class _Direction:
    """Bytes read from ``source`` and written to ``target`` ``delay`` seconds later."""

    def __init__(self, link: LaggingLink, source: socket.socket, target: socket.socket) -> None:
        self.link = link
        self.source = source
        self.target = target
        self.pending: deque[tuple[float, bytes]] = deque()
        self.wakeup = threading.Condition()
        self.finished = False

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name="link-read").start()
        threading.Thread(target=self._write, daemon=True, name="link-write").start()

    def _read(self) -> None:
        try:
            while True:
                data = self.source.recv(CHUNK)
                if not data:
                    break
                with self.wakeup:
                    self.pending.append((time.monotonic() + self.link.delay, data))
                    self.wakeup.notify()
        except OSError:
            pass
        with self.wakeup:
            self.finished = True
            self.wakeup.notify()

    def _write(self) -> None:
        try:
            while not self.link.is_cut:
                with self.wakeup:
                    while not self.pending and not self.finished and not self.link.is_cut:
                        self.wakeup.wait(0.5)
                    if self.link.is_cut or (self.finished and not self.pending):
                        break
                    due, data = self.pending[0]
                    wait = due - time.monotonic()
                    if wait > 0:
                        self.wakeup.wait(min(wait, 0.05))
                        continue
                    self.pending.popleft()
                self.target.sendall(data)
        except OSError:
            pass
        finally:
            # The other end learns that this side hung up (unless the link was cut:
            # then the sockets are closed already).
            with contextlib.suppress(OSError):
                self.target.shutdown(socket.SHUT_WR)


class LaggingLink:
    """``with LaggingLink(target_port, delay) as link:`` a relay on ``link.port``."""

    def __init__(self, target_port: int, delay: float) -> None:
        self.target_port = target_port
        #: Seconds each chunk waits before it is handed on; may change while running.
        self.delay = delay
        self.port = free_port()
        self.is_cut = False
        self.connections = 0
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._directions: list[_Direction] = []
        self._lock = threading.Lock()

    def __enter__(self) -> LaggingLink:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(8)
        self._listener = listener
        threading.Thread(target=self._accept, daemon=True, name="link-accept").start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cut()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self.is_cut:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self.is_cut:
                    client.close()
                    server.close()
                    return
                self.connections += 1
                self._sockets += [client, server]
                pair = [_Direction(self, client, server), _Direction(self, server, client)]
                self._directions += pair
            for direction in pair:
                direction.start()

    def in_transit(self) -> int:
        """Bytes read from one end and not yet handed to the other."""
        with self._lock:
            directions = list(self._directions)
        total = 0
        for direction in directions:
            with direction.wakeup:
                total += sum(len(data) for _, data in direction.pending)
        return total

    def cut(self) -> int:
        """The link goes down: everything closes, bytes in transit are dropped (returned)."""
        with self._lock:
            if self.is_cut:
                return 0
            self.is_cut = True
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, []
            directions = list(self._directions)
        dropped = 0
        for direction in directions:
            with direction.wakeup:
                dropped += sum(len(data) for _, data in direction.pending)
                direction.pending.clear()
                direction.wakeup.notify_all()
        for sock in [*([listener] if listener else []), *sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        return dropped
