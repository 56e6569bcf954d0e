"""Two hosts made of network namespaces joined by one veth pair, for cross-host benchmarks.

    server host  10.77.0.1/24  <-- veth pair -->  10.77.0.2/24  client host

Each host is a network namespace of its own (with its own loopback), and every process
started on it also gets a UTS namespace with the host's own hostname, so pstrain's
handshake, which compares (hostname, boot id, pid namespace), sees two hosts as it would on
two machines. The link is the kernel's veth: a loopback between namespaces through the TCP
stacks, not a NIC. Creating namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and
iproute2's `ip`; `unavailable_reason()` says why not where they are missing. The same
construction (with a bridge and four hosts) is tests/docker/test_bare_metal.py's.

Run as a script, this module is the wrapper that gives a process its host name:

    python benchmarks/netns.py HOSTNAME -- COMMAND [ARGS...]

sets the hostname of the (already unshared) UTS namespace and execs COMMAND, so the pid
that started it stays the command's.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SERVER_ADDRESS = "10.77.0.1"
CLIENT_ADDRESS = "10.77.0.2"
PREFIX_LEN = 24
IP_TIMEOUT_S = 30.0


class HostsError(RuntimeError):
    """The namespaces could not be made or removed; the message quotes `ip`'s error."""


class NotPermittedError(HostsError):
    """This process may not create network namespaces here."""


@dataclass(frozen=True)
class Host:
    """One emulated host: its network namespace, address, link device and hostname."""

    namespace: str
    address: str
    device: str
    hostname: str

    def command(self, args: list[str]) -> list[str]:
        """The command line that runs `args` on this host. `ip netns exec`, `unshare` (without
        a fork) and the hostname wrapper all exec, so the started pid is the command's."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", sys.executable,
                str(Path(__file__).resolve()), self.hostname, "--", *args]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs `ip ARGS` (blocks up to IP_TIMEOUT_S). HostsError with its stderr on failure
    when `check`; NotPermittedError when the kernel refused for lack of privilege."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                          check=False)
    if check and done.returncode != 0:
        err = done.stderr.strip()
        cls = (NotPermittedError if "Operation not permitted" in err
               or "Permission denied" in err else HostsError)
        raise cls(f"`ip {' '.join(args)}` failed: {err}")
    return done


def unavailable_reason() -> str:
    """Why two hosts cannot be made here, or "" when they probably can. Does not block long."""
    if os.geteuid() != 0:
        return ("network namespaces need root (CAP_NET_ADMIN); this runs as uid "
                f"{os.geteuid()}")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is not installed (iproute2, util-linux)"
    probe = ip("netns", "list", check=False)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return ""


@contextmanager
def host_pair(tag: str) -> Iterator[tuple[Host, Host]]:
    """Creates (server host, client host) joined by a veth pair and deletes both namespaces
    (and with them the veth pair) on exit, even on failure or KeyboardInterrupt. Processes
    still running in them must be ended by the caller before the block exits: a namespace
    outlives `ip netns del` while a process is in it. Blocks while `ip` runs.
    NotPermittedError when the kernel refuses."""
    server = Host(f"pstrain-x{tag}-a", SERVER_ADDRESS, f"pxa{tag}", f"pstrain-x{tag}-a")
    client = Host(f"pstrain-x{tag}-b", CLIENT_ADDRESS, f"pxb{tag}", f"pstrain-x{tag}-b")
    made: list[str] = []
    try:
        for host in (server, client):
            ip("netns", "add", host.namespace)
            made.append(host.namespace)
        # Made inside the server's namespace, so a failure leaves nothing in the root one.
        ip("-n", server.namespace, "link", "add", server.device, "type", "veth", "peer",
           "name", client.device, "netns", client.namespace)
        for host in (server, client):
            ip("-n", host.namespace, "link", "set", "lo", "up")
            ip("-n", host.namespace, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev",
               host.device)
            ip("-n", host.namespace, "link", "set", host.device, "up")
        yield server, client
    finally:
        for ns in reversed(made):
            ip("netns", "del", ns, check=False)
        left = ip("netns", "list", check=False).stdout
        stale = [ns for ns in made if ns in left.split()]
        if stale:
            raise HostsError(f"network namespaces {stale} are left; remove them with "
                             "`ip netns del NAME`")


def mtu(host: Host) -> int:
    """The MTU of the host's link device."""
    out = ip("-n", host.namespace, "-o", "link", "show", host.device).stdout.split()
    return int(out[out.index("mtu") + 1])


def _exec_as(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: netns.py HOSTNAME -- COMMAND [ARGS...]")
    socket.sethostname(argv[0])
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    _exec_as(sys.argv[1:])
