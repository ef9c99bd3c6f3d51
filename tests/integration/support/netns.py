"""Several hosts on one machine, for the fleet tests: network namespaces on a bridge, or loopback addresses.

`make_hosts(n, workdir)` gives N hosts, each with the address its daemon
listens on and its trainers dial, a way to run a command on it, and a
shared-memory dir of its own. Two modes:

- "netns" (root, and `ip` from iproute2): a bridge in the root namespace
  (`<subnet>.1/24`, the gateway: the S3 server binds it), one network
  namespace per host with a veth into the bridge (`<subnet>.11`, `.12`, ...)
  and `lo` up. A host's processes are started with `ip netns exec NS ...`
  (which execs, so the Popen's pid is the process itself). They see only
  their own loopback and the bridge: a trainer on host B cannot reach host
  A's daemon on A's 127.0.0.1, and nobody reaches the root namespace's
  127.0.0.1. Files are shared (a namespace of the network only), so port
  files are read from the root namespace as usual.
- "loopback" (the fallback when namespaces cannot be made: not root, no
  `ip`, a kernel or container that refuses them): hosts are 127.0.0.11,
  .12, ... of the one loopback, the gateway is 127.0.0.1, and commands run
  as they are. Separate addresses and shared-memory dirs are all that
  separates the hosts then.

`CHECKPOINTD_FLEET_HOSTS=loopback` forces the fallback (to test it where
namespaces work). `mode()` says, before anything is made, which mode will
run; the fleet tests put it in their ids, so the test output names it.

Names are unique per process (the pid) and the /24 is one no interface of
this machine has yet, so parallel sessions do not clash. `Hosts.remove()`
kills what still runs in the namespaces (only processes the tests started
can be there), deletes the namespaces (their veths go with them), the
bridge and the shared-memory dirs; it is safe to call twice and is called
from the fixture's finalizer and from atexit, so a failed test or an
interrupted session leaves nothing behind.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

NETNS = "netns"
LOOPBACK = "loopback"
FORCE_ENV = "CHECKPOINTD_FLEET_HOSTS"
_SUBNETS = ipaddress.ip_network("10.231.0.0/16")  # /24s of it are tried in turn


@dataclass(frozen=True)
class Host:
    """One host of the fleet: where its daemon listens, how to run a command there."""

    name: str  # "a", "b", ...
    address: str  # the host's own address: its daemon binds it, its trainers dial it
    netns: str | None  # the network namespace, None on the loopback fallback
    shm_dir: Path  # this host's shared-memory dir (the daemon's --shm-dir)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)


@dataclass
class Hosts:
    """The hosts made by `make_hosts`, and what removes them."""

    mode: str  # NETNS or LOOPBACK
    gateway: str  # the root namespace's address the hosts reach (the S3 server binds it)
    hosts: list[Host]
    why: str  # for the fallback: why namespaces could not be made
    _bridge: str | None = None
    _removed: bool = field(default=False, repr=False)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def remove(self) -> None:
        """Deletes every namespace, veth and bridge made, and the shared-memory dirs; idempotent."""
        if self._removed:
            return
        self._removed = True
        for host in self.hosts:
            if host.netns is not None:
                _kill_inside(host.netns)
                _ip("netns", "delete", host.netns, check=False)
            shutil.rmtree(host.shm_dir, ignore_errors=True)
        if self._bridge is not None:
            _ip("link", "delete", self._bridge, check=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise OSError(f"ip {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _kill_inside(netns: str) -> None:
    """SIGKILLs what still runs in a namespace the tests made (their own daemons and trainers)."""
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@functools.cache
def _probe() -> str:
    """ "" if network namespaces can be made here, else why not."""
    if os.environ.get(FORCE_ENV) == LOOPBACK:
        return f"{FORCE_ENV}=loopback"
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    name = f"cpdprobe{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "delete", name, check=False)
    return ""


def mode() -> str:
    """The mode `make_hosts` will use here: NETNS or LOOPBACK."""
    return LOOPBACK if _probe() else NETNS


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.231.0.0/16 that no interface of this machine is in (another session's bridge)."""
    listing = _ip("-4", "-o", "addr", "show").stdout
    taken = [ipaddress.ip_interface(cidr).network for cidr in re.findall(r"\binet (\S+/\d+)", listing)]
    start = os.getpid() % 250
    subnets = list(_SUBNETS.subnets(new_prefix=24))[1:251]
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if not any(net.overlaps(t) for t in taken):
            return net
    raise OSError("every /24 of 10.231.0.0/16 is in use on this machine")


def _shm_dir(tag: str) -> Path:
    base = Path("/dev/shm")
    if not base.is_dir():
        base = Path("/tmp")
    path = base / f"checkpointd-fleet-{os.getpid()}-{tag}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def make_hosts(n: int) -> Hosts:
    """N hosts, as namespaces on a bridge where that works, else as loopback addresses.

    Raises:
        OSError: namespaces were possible but making them failed (what was
            made is removed first).
    """
    names = [chr(ord("a") + i) for i in range(n)]
    why = _probe()
    if why:
        hosts = [Host(x, f"127.0.0.{11 + i}", None, _shm_dir(x)) for i, x in enumerate(names)]
        made = Hosts(LOOPBACK, "127.0.0.1", hosts, why)
        atexit.register(made.remove)
        return made
    tag = f"cpd{os.getpid()}"  # 15 characters at most in an interface name: cpd + pid + host
    net = _free_subnet()
    gateway = str(net.network_address + 1)
    made = Hosts(NETNS, gateway, [], "", _bridge=f"{tag}br")
    atexit.register(made.remove)
    try:
        _ip("link", "add", made._bridge, "type", "bridge")  # type: ignore[arg-type]
        _ip("addr", "add", f"{gateway}/24", "dev", made._bridge)  # type: ignore[arg-type]
        _ip("link", "set", made._bridge, "up")  # type: ignore[arg-type]
        for i, x in enumerate(names):
            netns, veth = f"{tag}-{x}", f"{tag}{x}"
            address = str(net.network_address + 11 + i)
            _ip("netns", "add", netns)
            made.hosts.append(Host(x, address, netns, _shm_dir(x)))
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("link", "set", veth, "master", made._bridge, "up")  # type: ignore[arg-type]
            inside = ("netns", "exec", netns, "ip")
            _ip(*inside, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "link", "set", "lo", "up")
    except BaseException:
        made.remove()
        raise
    return made
