"""A TCP proxy in front of a live gunicorn that breaks chosen requests, as a network would.

The client recipe's live tests (tests/live/test_client_recipe_live.py) send
every request through it. It reads one HTTP/1.1 request per connection,
forwards it to gunicorn with ``Connection: close`` (so that the server's
closing the connection ends its answer), and, on the *first* request that
carries a chosen ``Idempotency-Key``, applies that key's fault:

- ``ANSWER_DROPPED``: the server's whole answer is read, then the client's
  connection is reset: the operation ran and its client never heard.
- ``CUT_AFTER_CLAIM``: the client's connection is reset as soon as the
  server has claimed the key (its record is in the database), while the view
  still runs: the retry meets the running request or its stored outcome.
- ``WORKER_KILLED``: once the server has claimed the key, the gunicorn worker
  that claimed it (the pid in the record's ``lease_owner``) is SIGKILLed in
  the middle of the view; gunicorn starts another in its place.

Every request is recorded as an ``Exchange`` (when it arrived, the answer
the server gave, whether the client got it, and when), so that a test can
tell what really happened to each attempt, and how long the client waited
after each answer.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import socket
import socketserver
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: How long a fault waits for the server to claim the key before giving up.
CLAIM_TIMEOUT = 10.0
SOCKET_TIMEOUT = 30.0


class Fault(enum.Enum):
    ANSWER_DROPPED = "answer dropped"
    CUT_AFTER_CLAIM = "cut after the claim"
    WORKER_KILLED = "worker killed"


@dataclass
class Exchange:
    """One request through the proxy and what became of it."""

    key: str
    fault: Fault | None
    arrived: float
    request_body: bytes = b""
    #: The server's answer; None when it gave none (its worker was killed).
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: Whether the answer reached the client, and when it was sent or dropped.
    delivered: bool = False
    answered: float = 0.0

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed") == "true"

    @property
    def retry_after(self) -> float | None:
        value = self.headers.get("retry-after")
        return float(value) if value is not None else None

    def describe(self) -> str:
        fault = f" [{self.fault.value}]" if self.fault else ""
        delivered = "" if self.delivered else " (not delivered)"
        interesting = {k: v for k, v in self.headers.items() if k.startswith(("idem", "retry"))}
        return f"{self.status}{fault}{delivered} {interesting} {self.body[:120]!r}"


def read_request(connection: socket.socket) -> tuple[bytes, bytes]:
    """The head (up to the blank line) and the body (Content-Length bytes) of one request."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            raise ConnectionError("the client closed before sending a whole request")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(parse_headers(head).get("content-length", "0"))
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            raise ConnectionError("the client closed in the middle of the body")
        body += chunk
    return head, body


def parse_headers(head: bytes) -> dict[str, str]:
    """Header names (lower case) and values of a request's or response's head."""
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines)
    }


def closing(head: bytes) -> bytes:
    """The request head with ``Connection: close`` instead of any connection header."""
    lines = head.split(b"\r\n")
    kept = [
        line
        for line in lines[1:]
        if line.split(b":", 1)[0].strip().lower() not in (b"connection", b"keep-alive")
    ]
    return b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n"


def read_until_closed(connection: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(OSError):  # a killed worker's socket may reset
        while chunk := connection.recv(65536):
            data += chunk
    return data


def reset(connection: socket.socket) -> None:
    """Close with a TCP reset, as a broken network or a dying peer does."""
    with contextlib.suppress(OSError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


def parent_of(pid: int) -> int:
    # /proc/<pid>/stat: "pid (comm) state ppid ...", comm may hold spaces.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    # socketserver's default backlog, 5, would refuse some of the test's
    # simultaneous connections: faults nobody chose.
    request_queue_size = 128


class FaultProxy:
    """The proxy on a free local port; ``url`` is where clients send their requests.

    ``faults``: the fault of each key's first request. ``claimer(key)``: the
    pid of the process whose claim on ``key`` is in the database, or None
    while there is none. ``master_pid``: gunicorn's master; only its
    workers are ever killed.
    """

    def __init__(
        self,
        upstream_port: int,
        claimer: Callable[[str], int | None],
        master_pid: int,
    ) -> None:
        self.upstream_port = upstream_port
        self.claimer = claimer
        self.master_pid = master_pid
        self.faults: dict[str, Fault] = {}
        self.exchanges: dict[str, list[Exchange]] = defaultdict(list)
        self.killed: list[int] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy.relay(self.request)

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def break_first_request(self, faults: Mapping[str, Fault]) -> None:
        with self._lock:
            self.faults.update(faults)

    def history(self, key: str) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges.get(key, []))

    # -- one connection ----------------------------------------------------------------

    def relay(self, client: socket.socket) -> None:
        client.settimeout(SOCKET_TIMEOUT)
        try:
            head, body = read_request(client)
        except (ConnectionError, OSError):
            client.close()
            return
        key = parse_headers(head).get("idempotency-key", "")
        exchange = self._record(key, body)
        with socket.create_connection(("127.0.0.1", self.upstream_port), SOCKET_TIMEOUT) as server:
            server.sendall(closing(head) + body)
            if exchange.fault in (Fault.CUT_AFTER_CLAIM, Fault.WORKER_KILLED):
                pid = self._wait_for_claim(key)
                if exchange.fault is Fault.WORKER_KILLED:
                    self._kill_worker(pid)
                exchange.answered = time.monotonic()
                reset(client)
            answer = read_until_closed(server)
        answer_head, _, exchange.body = answer.partition(b"\r\n\r\n")
        if answer_head:
            exchange.status = int(answer_head.split(b" ", 2)[1])
            exchange.headers = parse_headers(answer_head)
        if exchange.fault is None and answer:
            with contextlib.suppress(OSError):
                client.sendall(answer)
                exchange.delivered = True
            exchange.answered = time.monotonic()
            client.close()
        elif exchange.fault not in (Fault.CUT_AFTER_CLAIM, Fault.WORKER_KILLED):
            exchange.answered = time.monotonic()
            reset(client)

    def _record(self, key: str, body: bytes) -> Exchange:
        with self._lock:
            earlier = self.exchanges[key]
            fault = self.faults.get(key) if not earlier else None
            exchange = Exchange(key, fault, arrived=time.monotonic(), request_body=body)
            earlier.append(exchange)
            return exchange

    def _wait_for_claim(self, key: str) -> int:
        deadline = time.monotonic() + CLAIM_TIMEOUT
        while (pid := self.claimer(key)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server never claimed {key!r}")
            time.sleep(0.01)
        return pid

    def _kill_worker(self, pid: int) -> None:
        if parent_of(pid) != self.master_pid:
            raise RuntimeError(f"{pid} is not a worker of gunicorn {self.master_pid}")
        os.kill(pid, signal.SIGKILL)
        with self._lock:
            self.killed.append(pid)
