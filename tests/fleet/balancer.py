"""nginx in front of the fleet, configured to resend a POST that timed out to another host.

By default nginx never passes a non-idempotent request (POST, PATCH, ...)
to the next upstream once it was sent: ``proxy_next_upstream`` needs
``non_idempotent``. Many deployments add it (often copied from a guide on
"retry on timeout"), and then a slow POST is sent again, to another host,
while the first copy still runs. That is the duplicate this fleet is made
to produce:

    proxy_next_upstream error timeout non_idempotent;
    proxy_read_timeout <READ_TIMEOUT>;
    proxy_next_upstream_tries 2;

nginx rather than HAProxy: its access log's ``$upstream_addr`` lists every
host a request went to ("10.0.0.11:8000, 10.0.0.12:8000"), so the test
counts the resends from the log, and ``non_idempotent`` is the directive
people actually meet. ``max_fails=0``: a host is never marked down, so
after a timeout the next request still goes round the three.

It runs in the foreground (``daemon off``) from a prefix directory of its
own, with its own config, pid file, logs and temporary directories, on a
free port of 127.0.0.1; never as the system's service.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.live.processes import BackgroundProcess
from tests.live.server import free_port

#: Seconds nginx waits for a host's answer before resending the POST elsewhere.
READ_TIMEOUT = 1.5
LOG_FORMAT = (
    "status=$status key=$http_idempotency_key "
    'upstreams="$upstream_addr" upstream_statuses="$upstream_status" '
    "time=$request_time"
)
ACCESS_LINE = re.compile(r'status=(\d+) key=(\S*) upstreams="([^"]*)" upstream_statuses="([^"]*)"')


@dataclass(frozen=True)
class Passage:
    """One request as nginx logged it."""

    status: int
    key: str
    upstreams: tuple[str, ...]
    upstream_statuses: tuple[str, ...]

    @property
    def resent(self) -> bool:
        return len(self.upstreams) > 1


class Nginx(BackgroundProcess):
    name = "nginx"

    def __init__(self, log_dir: Path, upstreams: Sequence[str]) -> None:
        super().__init__(log_dir)
        self.prefix = log_dir / "nginx"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.upstreams = list(upstreams)
        self.access_log = self.prefix / "access.log"

    def config(self) -> str:
        servers = "\n".join(f"        server {address} max_fails=0;" for address in self.upstreams)
        prefix = self.prefix
        return f"""
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format fleet '{LOG_FORMAT}';
    access_log {self.access_log} fleet;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream fleet {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{self.port};
        location / {{
            proxy_pass http://fleet;
            proxy_set_header Host $host;
            proxy_connect_timeout 1s;
            proxy_read_timeout {int(READ_TIMEOUT * 1000)}ms;
            proxy_next_upstream error timeout non_idempotent;
            proxy_next_upstream_tries 2;
        }}
    }}
}}
"""

    def start(self) -> None:
        self.prefix.mkdir(parents=True, exist_ok=True)
        config = self.prefix / "nginx.conf"
        config.write_text(self.config())
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        command = [
            binary,
            "-p",
            str(self.prefix),
            "-c",
            str(config),
            "-e",
            str(self.prefix / "error.log"),
        ]
        self._spawn(command, {"PATH": "/usr/sbin:/usr/bin:/bin"}, self.prefix)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                requests.get(self.url + "/v1/payments", timeout=2)
                return
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("nginx did not start.\n" + self.diagnostics())

    def passages(self) -> list[Passage]:
        try:
            text = self.access_log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        found = []
        for match in ACCESS_LINE.finditer(text):
            status, key, upstreams, statuses = match.groups()
            found.append(
                Passage(
                    int(status),
                    "" if key == "-" else key,
                    tuple(part.strip() for part in upstreams.split(",")),
                    tuple(part.strip() for part in statuses.split(",")),
                )
            )
        return found

    def diagnostics(self, lines: int = 40) -> str:
        error_log = self.prefix / "error.log"
        tail = ""
        if error_log.exists():
            tail = "\n".join(error_log.read_text(errors="replace").splitlines()[-lines:])
        return super().diagnostics(lines) + f"\n--- nginx error.log ---\n{tail}\n---"
