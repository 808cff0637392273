"""Hosts with their own addresses: Linux network namespaces on one bridge, for multi-node runs (the local
executor's `--netns`) and tests.

Every multi-node test otherwise runs its nodes as processes on one host over 127.0.0.1, where a
killed node's peers see its sockets close at once (RST/FIN). A preempted VM vanishes silently: its
packets just stop. `Hosts(n)` gives each node a namespace of its own, with one veth into a bridge in
the root namespace, so a test can make a node's link go quiet:

    with Hosts(2) as hosts:
        subprocess.Popen([*hosts.exec_prefix(1), "python", "server.py", hosts.addr(1)])
        hosts.cut(1)    # every packet to and from host 1 dropped, nothing reset
        hosts.heal(1)

Addresses: the bridge 10.213.X.254/24 (the host side: bind a store or an HTTP server a node must reach
there; a namespace cannot reach the root namespace's 127.0.0.1), host k 10.213.X.(k+1)/24 on an
interface named `IFNAME` inside its namespace, X random among the subnets no interface here uses.

How packets are dropped: a cBPF program in direct-action mode on the clsact qdisc of host k's
interface, egress and ingress (`tc filter ... bpf da`), returning TC_ACT_SHOT. It needs only
CONFIG_NET_CLS_BPF and CONFIG_NET_SCH_INGRESS, which kernels without sch_netem (this one) still have.
A packet shot there was never sent: the peer's TCP sees nothing, no RST and no FIN, and keeps
retransmitting until its own timeout (tests/test_netns.py checks exactly that). `netem(k, delay_ms=)`
needs sch_netem (`tc qdisc ... netem`); without it, it raises NetemUnavailable.

Cleanup: teardown deletes the namespaces (their veths go with them) and the bridge, also when the
test fails. The bridge carries an alias naming the creating process; `Hosts` removes, on entry, every
bridge and namespace of ours whose creator is no longer alive.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
from typing import Optional

IFNAME = "eth0"  # each host's interface inside its namespace (GLOO_SOCKET_IFNAME for a trainer there)
NS_PREFIX = "skyspot-net-"
ALIAS_PREFIX = "skyspot-netns pid="
BRIDGE_PREFIX = "sknb"
SUBNET = "10.213"

# cBPF for `tc filter ... bpf da bytecode`: "COUNT,code jt jf k,...". In direct-action mode the return
# value is the tc action: 0 TC_ACT_OK, 2 TC_ACT_SHOT (linux/pkt_cls.h). cls_bpf runs the program with the
# Ethernet header at offset 0 on both egress and ingress (net/sched/cls_bpf.c pushes mac_len at ingress).
_RET_OK, _RET_SHOT = "6 0 0 0", "6 0 0 2"
_DROP_ALL = f"1,{_RET_SHOT}"
_SKF_AD_RANDOM = 2**32 - 0x1000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM (linux/filter.h): A = a random u32


class NetnsUnavailable(RuntimeError):
    """Why Hosts cannot run here (not root, no `ip`, no netns support)."""


class NetemUnavailable(RuntimeError):
    """The kernel has no sch_netem, so no added delay."""


def unavailable_reason() -> Optional[str]:
    """None when Hosts can run here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (`ip`, `tc`) is not installed"
    name = f"{NS_PREFIX}probe-{os.getpid()}-{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip_u32(address: str) -> int:
    a, b, c, d = (int(p) for p in address.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
    return done


def clean_leftovers() -> list[str]:
    """Remove our bridges and namespaces whose creating process is gone; returns what was removed."""
    removed = []
    for line in _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.match(r"\d+: ([^:@]+)", line)
        alias = re.search(rf"alias {re.escape(ALIAS_PREFIX)}(\d+)", line)
        if m and m.group(1).startswith(BRIDGE_PREFIX) and alias and not _pid_alive(int(alias.group(1))):
            _run("ip", "link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    links = _run("ip", "-o", "link", check=False).stdout
    bridges = set(re.findall(rf"^\d+: ({BRIDGE_PREFIX}[0-9a-f]+):", links, re.M))
    for peer, bridge in re.findall(rf"^\d+: (({BRIDGE_PREFIX}[0-9a-f]+)h\d+)@", links, re.M):
        if bridge not in bridges:  # a host-side veth whose bridge is gone
            _run("ip", "link", "del", peer, check=False)
            removed.append(peer)
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{re.escape(NS_PREFIX)}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> int:
    used = set(re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", _run("ip", "-o", "addr", check=False).stdout))
    for _ in range(64):
        x = secrets.randbelow(250) + 1
        if str(x) not in used:
            return x
    raise NetnsUnavailable(f"no free {SUBNET}.X.0/24 subnet found")


class Hosts:
    """n namespaces, each one host with its own address on a shared bridge (see the module docstring)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("Hosts needs at least one host")
        self.n = n
        self.tag = secrets.token_hex(3)
        self.x = 0
        self.bridge = f"{BRIDGE_PREFIX}{self.tag}"
        self.namespaces = [f"{NS_PREFIX}{os.getpid()}-{self.tag}-{k}" for k in range(n)]
        self._made: list[str] = []

    # -- addresses ------------------------------------------------------------------------------
    @property
    def bridge_addr(self) -> str:
        """The root namespace's address on the bridge: where a server every host must reach listens."""
        return f"{SUBNET}.{self.x}.254"

    def addr(self, k: int) -> str:
        return f"{SUBNET}.{self.x}.{k + 1}"

    @property
    def addrs(self) -> list[str]:
        return [self.addr(k) for k in range(self.n)]

    def exec_prefix(self, k: int) -> list[str]:
        """Prepend to a command to run it on host k."""
        return ["ip", "netns", "exec", self.namespaces[k]]

    # -- setup and teardown ---------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        clean_leftovers()
        self.x = _free_subnet()
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append(self.bridge)
            _run("ip", "link", "set", "dev", self.bridge, "alias", f"{ALIAS_PREFIX}{os.getpid()}")
            _run("ip", "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for k, ns in enumerate(self.namespaces):
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
                peer = f"{self.bridge}h{k}"  # the host side, in the root namespace (<= 15 characters)
                _run("ip", "link", "add", peer, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _run("ip", "link", "set", peer, "master", self.bridge)
                _run("ip", "link", "set", peer, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", IFNAME)
                _run("ip", "-n", ns, "link", "set", IFNAME, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what still runs on the hosts, delete the namespaces (and with them the veths) and the bridge."""
        for k, ns in enumerate(self.namespaces):
            if ns in self._made:
                # Deleting one end of a veth deletes the pair at once; a namespace's own go asynchronously.
                _run("ip", "link", "del", f"{self.bridge}h{k}", check=False)
                for pid in self._pids(ns):
                    for sig in (signal.SIGKILL, signal.SIGCONT):
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
                _run("ip", "netns", "del", ns, check=False)
        if self.bridge in self._made:
            _run("ip", "link", "del", self.bridge, check=False)
        self._made.clear()

    # -- faults ---------------------------------------------------------------------------------
    def _filters(self, k: int, egress: Optional[str], ingress: Optional[str]) -> None:
        ns = self.namespaces[k]
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", IFNAME, "clsact", check=False)
        if egress is None and ingress is None:
            return
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "clsact")
        for hook, program in (("egress", egress), ("ingress", ingress)):
            if program is not None:
                _run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "filter",
                    "add",
                    "dev",
                    IFNAME,
                    hook,
                    "bpf",
                    "da",
                    "bytecode",
                    program,
                )

    def cut(self, k: int) -> None:
        """Host k's link goes silent: every packet it sends or would receive is dropped, nothing is reset."""
        self._filters(k, _DROP_ALL, _DROP_ALL)

    def partition(self, k: int) -> None:
        """Host k cannot reach the other hosts, nor they it; its loopback and the bridge address still work."""

        def program(offset: int) -> str:  # drop IPv4 whose address at `offset` is another host's
            subnet, bridge = _ip_u32(self.addr(0)) & 0xFFFFFF00, _ip_u32(self.bridge_addr)
            steps = [
                "40 0 0 12",  # A = ethertype
                "21 0 5 2048",  # not IPv4: pass
                f"32 0 0 {offset}",  # A = the address
                f"21 3 0 {bridge}",  # the bridge's: pass
                "84 0 0 4294967040",  # A &= 255.255.255.0
                f"21 0 1 {subnet}",  # in the hosts' subnet: drop
                _RET_SHOT,
                _RET_OK,
            ]
            return f"{len(steps)}," + ",".join(steps)

        self._filters(k, program(30), program(26))  # egress: destination; ingress: source

    def heal(self, k: int) -> None:
        """Undo cut, partition and netem on host k."""
        self._filters(k, None, None)
        _run("ip", "netns", "exec", self.namespaces[k], "tc", "qdisc", "del", "dev", IFNAME, "root", check=False)

    def netem(self, k: int, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Add delay (sch_netem, on host k's egress) and random loss (each way) to host k's link."""
        ns = self.namespaces[k]
        if delay_ms > 0:
            done = _run(
                "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", IFNAME, "root", "netem", "delay", f"{delay_ms}ms",
                check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise NetemUnavailable(f"tc netem: {done.stderr.strip()} (this kernel has no sch_netem)")
        if loss_pct > 0:
            threshold = min(int(loss_pct / 100 * 2**32), 2**32 - 1)
            program = f"4,32 0 0 {_SKF_AD_RANDOM},53 1 0 {threshold},{_RET_SHOT},{_RET_OK}"  # A >= t: pass
            self._filters(k, program, program)

    @staticmethod
    def _pids(ns: str) -> list[int]:
        return [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]

    def pids(self, k: int) -> list[int]:
        return self._pids(self.namespaces[k])

    def freeze(self, k: int) -> None:
        """SIGSTOP every process on host k: no exit, no socket closes, nothing answers."""
        for pid in self.pids(k):
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass

    def thaw(self, k: int) -> None:
        for pid in self.pids(k):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
