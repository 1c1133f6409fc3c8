"""Round trips counted on the wire: a relay between Django and PostgreSQL.

Django's query log is not the wire: it logs BEGIN when an atomic block
starts and COMMIT when it ends, while psycopg sends BEGIN only with the
block's first statement and no COMMIT when none was sent. So the relay
counts what the client really sends: each simple Query message and each
Sync message (the end of an extended-protocol statement) is answered by one
ReadyForQuery, and psycopg, outside its pipeline mode (which Django does
not use), waits for that answer before sending anything else: one round
trip each.

Connections to the relay must not ask for TLS or GSS encryption
(``sslmode=disable``, ``gssencmode=disable``): the relay reads the
protocol in clear.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

#: The untyped requests a client may send before its startup message.
_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


class RoundTripRelay:
    """Listens on 127.0.0.1 and relays every connection to ``target``, counting round trips."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._count = 0
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._count

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, server]
            threading.Thread(target=self._from_client, args=(client, server), daemon=True).start()
            threading.Thread(target=self._copy, args=(server, client), daemon=True).start()

    @staticmethod
    def _copy(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _from_client(self, client: socket.socket, server: socket.socket) -> None:
        """Relay the client's bytes, counting its Query and Sync messages before forwarding them."""
        buffer = b""
        untyped = True  # the startup message (and any encryption request) has no type byte
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                buffer += data
                while True:
                    if untyped:
                        if len(buffer) < 8:
                            break
                        length, code = struct.unpack("!II", buffer[:8])
                        if len(buffer) < length:
                            break
                        buffer = buffer[length:]
                        untyped = code in (_SSL_REQUEST, _GSSENC_REQUEST)
                        continue
                    if len(buffer) < 5:
                        break
                    kind = buffer[:1]
                    (length,) = struct.unpack("!I", buffer[1:5])
                    if len(buffer) < 1 + length:
                        break
                    buffer = buffer[1 + length :]
                    if kind in (b"Q", b"S"):
                        with self._lock:
                            self._count += 1
                server.sendall(data)
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_WR)
