"""The node's network for a multi-node rendezvous: its private IP, the interface that carries it,
and torchrun's rendezvous flags.

gloo (every object collective, the checkpoint groups) and NCCL's bootstrap pick their address
from the host name or the first interface they like; an image that maps the host name to
127.0.1.1, or a docker0 bridge, then makes cross-node connects fail or hang. So
:func:`network_env` pins both to the interface that carries this node's private IP
(:func:`node_ip`), and refuses (ConfigError, exit 2) a rendezvous the other nodes could not reach.
Standard library only.
"""

from __future__ import annotations

import socket
import subprocess

from infra.node_config import ConfigError, NodeConfig
from orchestrator.contract import nodeenv

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""What pins gloo and NCCL to one interface."""


def node_ip(env: dict[str, str], rank: int, master: str | None) -> str | None:
    """This node's private IP: SkyPilot's ``SKYPILOT_NODE_IPS`` line for the rank; else the
    address this host would use to reach the rendezvous host (a UDP ``connect`` sends nothing);
    else what the host name resolves to."""
    ips = [ip.strip() for ip in env.get(nodeenv.SKYPILOT_NODE_IPS, "").splitlines() if ip.strip()]
    if 0 <= rank < len(ips):
        return ips[rank]
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def ipv4_by_interface() -> dict[str, list[str]]:
    """Each network interface's IPv4 addresses: ``ip -o -4 addr show`` (secondary addresses too),
    else each interface's primary address through ``SIOCGIFADDR`` (stdlib only)."""
    out: dict[str, list[str]] = {}
    try:
        text = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10,
                              check=True).stdout
        for line in text.splitlines():  # "4: eth0    inet 10.0.0.5/24 brd … scope global eth0\ …"
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "inet":
                out.setdefault(parts[1].split("@")[0], []).append(parts[3].split("/")[0])
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            out.setdefault(name, []).append(socket.inet_ntoa(raw[20:24]))
    return out


def _is_ip(addr: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in addr else socket.AF_INET, addr)
        return True
    except OSError:
        return False


def _loopback(addrs: list[str]) -> list[str]:
    return [a for a in addrs if a.startswith("127.") or a == "::1"]


def _resolve(host: str) -> list[str]:
    try:
        return sorted({i[4][0] for i in socket.getaddrinfo(host, None)})
    except OSError:
        return []


def network_env(cfg: NodeConfig, env: dict[str, str], ip: str | None, interfaces=ipv4_by_interface,
                resolve=_resolve) -> dict[str, str]:
    """Environment for a multi-node rendezvous (empty for one node), or ConfigError (exit 2).

    gloo (every object collective, the checkpoint groups) and NCCL's bootstrap pick their address
    from the hostname or the first interface they like; an image that maps the hostname to
    127.0.1.1, or a docker0 bridge, then makes cross-node connects fail or hang. So both are
    pinned to the interface that carries this node's private IP (``ip``: infra/node_report's
    ``node_ip`` — ``SKYPILOT_NODE_IPS[rank]``, else the source address of the route to the
    master); values already in the environment win. A master *hostname* that resolves to
    loopback is refused: the other nodes would dial themselves. All nodes on one host (a loopback
    master IP, as the tests run) need nothing."""
    if cfg.nnodes <= 1:
        return {}
    master = cfg.master_addr or ""
    if master and not _is_ip(master):
        lo = _loopback(resolve(master))
        if lo:
            raise ConfigError(f"master address {master!r} resolves to loopback ({', '.join(lo)}): the other "
                              f"nodes cannot reach it; set DTRUN_MASTER_ADDR (or SKYPILOT_NODE_IPS) to the "
                              f"master node's private IP")
    if _loopback([master]) or all(env.get(k) for k in SOCKET_IFNAME_VARS):
        return {}
    if not ip or _loopback([ip]):
        raise ConfigError(f"this node's address is {ip or 'unknown'} for a {cfg.nnodes}-node rendezvous at "
                          f"{master}: gloo would listen on loopback; set SKYPILOT_NODE_IPS or GLOO_SOCKET_IFNAME "
                          f"and NCCL_SOCKET_IFNAME")
    names = [n for n, ips in interfaces().items() if ip in ips]
    if not names:  # e.g. a public IP behind NAT (a container host): leave the choice to gloo/NCCL
        return {}
    return {k: names[0] for k in SOCKET_IFNAME_VARS if not env.get(k)}


def torchrun_flags(cfg: NodeConfig) -> list[str]:
    """torchrun's launcher flags for this node (everything before ``-m trainer``)."""
    # torchrun SIGKILLs workers --shutdown-timeout seconds after forwarding a SIGTERM (default 30):
    # give the emergency checkpoint the same grace the watchdog gives the whole node.
    flags = ["--nproc-per-node", str(cfg.nproc_per_node),
             "--shutdown-timeout", str(max(1, int(cfg.kill_grace_seconds)))]
    if cfg.nnodes == 1:
        return ["--standalone", *flags]
    return [*flags, "--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank),
            "--master-addr", str(cfg.master_addr), "--master-port", str(cfg.master_port)]
