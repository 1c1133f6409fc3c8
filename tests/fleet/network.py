"""The fleet's network: Linux network namespaces on a bridge, and partitions.

``FleetNetwork`` makes, for one test run (every name carries the test
process's pid, so two runs never collide):

- a bridge ``idb<pid>`` in the root namespace with the address
  ``10.<a>.<b>.1/24`` (a subnet chosen from the pid, checked unused), on
  which the shared services listen (PostgreSQL, Redis, the provider
  simulator) and from which the load balancer reaches the hosts;
- per host a namespace ``idem-<pid>-<name>`` and a veth pair: ``eth0``
  inside (``10.<a>.<b>.<11+i>/24``, default route via the bridge) and
  ``idh<pid>h<i>`` in the root namespace, enslaved to the bridge.

``partition(host)`` sets the host's root-side veth down: every packet
between the host and everything else is dropped silently in both
directions, with no RST, so established TCP connections hang exactly as
after a cable cut; ``heal(host)`` sets it up again and those connections
resume. No kernel module is needed (no netem, no iptables).

``close()`` (also on failure, via ``with``) kills whatever still runs in
the namespaces, deletes them, their links and the bridge.

Needs root and ``ip``; ``require_namespaces()`` skips the test otherwise,
or fails it under ``IDEMPOTENCY_REQUIRE_SERVICES=1``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from types import TracebackType

import pytest

from tests.live.services import REQUIRE_SERVICES_ENV, services_required


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    command = (
        ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result.stdout


def require_namespaces() -> None:
    """Skip (fail under IDEMPOTENCY_REQUIRE_SERVICES=1) unless namespaces can be made here."""
    problem = None
    if os.geteuid() != 0:
        problem = "network namespaces need root"
    elif shutil.which("ip") is None or shutil.which("unshare") is None:
        problem = "ip (iproute2) or unshare (util-linux) is not installed"
    else:
        probe = f"idem-probe-{os.getpid()}"
        try:
            ip("netns", "add", probe)
        except RuntimeError as exc:
            problem = str(exc)
        finally:
            ip("netns", "del", probe, check=False)
    if problem is not None:
        missing("network namespaces", problem)


def missing(what: str, problem: str) -> None:
    """Skip the running test, or fail it under IDEMPOTENCY_REQUIRE_SERVICES=1."""
    if services_required():
        pytest.fail(f"{what} required ({REQUIRE_SERVICES_ENV}=1) but unavailable: {problem}")
    pytest.skip(f"{what} unavailable: {problem} (run as root with iproute2, nginx, redis-server)")


def _used_subnets() -> set[ipaddress.IPv4Network]:
    text = ip("-4", "-o", "addr", "show")
    used = set()
    for line in text.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.add(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).network)
    return used


@dataclass
class Host:
    """One host of the fleet: a namespace, its address and its hostname."""

    index: int
    name: str
    namespace: str
    address: str
    #: The veth end in the root namespace: down = partitioned.
    outer_link: str

    def run_prefix(self) -> list[str]:
        """Prepended to a command to run it on this host, under this host's hostname.

        ``unshare --uts`` gives the process a UTS namespace of its own, so
        ``socket.gethostname()`` (the package's lease owners) names the host.
        """
        return [
            "ip", "netns", "exec", self.namespace,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', self.name,
        ]  # fmt: skip

    def pids(self) -> list[int]:
        """Every process running in this host's namespace."""
        output = subprocess.run(
            ["ip", "netns", "pids", self.namespace],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
        return [int(pid) for pid in output.split()]

    def kill_everything(self) -> list[int]:
        """``kill -9`` every process of the host at once: the machine died. Returns the pids."""
        killed: list[int] = []
        for _ in range(20):  # a master may fork a replacement between listing and killing
            pids = self.pids()
            if not pids:
                return killed
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.extend(pids)
            time.sleep(0.1)
        raise RuntimeError(f"processes survive in {self.namespace}: {self.pids()}")


class FleetNetwork:
    """A bridge and ``count`` hosts; ``with FleetNetwork(3) as network: ...``."""

    def __init__(self, count: int = 3) -> None:
        self.tag = str(os.getpid())
        self.bridge = f"idb{self.tag}"
        self.count = count
        self.subnet = self._free_subnet()
        hosts = list(self.subnet.hosts())
        self.gateway = str(hosts[0])
        self.hosts = [
            Host(
                index=i,
                name=f"fleet-h{i}",
                namespace=f"idem-{self.tag}-h{i}",
                address=str(hosts[10 + i - 1]),
                outer_link=f"idh{self.tag}h{i}",
            )
            for i in range(1, count + 1)
        ]

    def _free_subnet(self) -> ipaddress.IPv4Network:
        used = _used_subnets()
        pid = os.getpid()
        for attempt in range(256):
            number = (pid + attempt) % 65536
            candidate = ipaddress.IPv4Network(f"10.{200 + number // 256 % 50}.{number % 256}.0/24")
            if not any(candidate.overlaps(other) for other in used):
                return candidate
        raise RuntimeError("no free 10.x.y.0/24 subnet for the fleet")

    def __enter__(self) -> FleetNetwork:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                ip("netns", "add", host.namespace)
                ip("link", "add", host.outer_link, "type", "veth", "peer", "name", "eth0",
                   "netns", host.namespace)  # fmt: skip
                ip("link", "set", host.outer_link, "master", self.bridge)
                ip("link", "set", host.outer_link, "up")
                ip("addr", "add", f"{host.address}/24", "dev", "eth0", namespace=host.namespace)
                ip("link", "set", "eth0", "up", namespace=host.namespace)
                ip("link", "set", "lo", "up", namespace=host.namespace)
                ip("route", "add", "default", "via", self.gateway, namespace=host.namespace)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def partition(self, host: Host) -> None:
        """Cut ``host`` off: its packets are dropped both ways, silently."""
        ip("link", "set", host.outer_link, "down")

    def heal(self, host: Host) -> None:
        ip("link", "set", host.outer_link, "up")

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the links; never raises."""
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.kill_everything()
            ip("link", "del", host.outer_link, check=False)
            ip("netns", "del", host.namespace, check=False)
        ip("link", "del", self.bridge, check=False)
