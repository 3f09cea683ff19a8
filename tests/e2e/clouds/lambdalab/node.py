"""One lab "instance": a Linux machine made of namespaces, reachable over SSH on its own IP.

* network: its own netns ``dtlab-<n>`` with ``eth0`` (a veth whose host end is on the lab's
  bridge) at ``10.77.0.<n>/24``, a default route via the bridge (so Ray's node-IP detection picks
  ``eth0``; the host does not forward, so nothing leaves the machine);
* processes: its own PID and UTS namespace (tini is PID 1, hostname ``lambda-<n>``), so
  SkyPilot's ``sudo pkill -9 dpkg`` and ``kill -HUP $(cat /var/run/sshd.pid)`` only see the node;
* files: its own mount namespace: ``/etc``, ``/home``, ``/var``, ``/root`` are overlays over the
  host's (uppers on a tmpfs that dies with the node), ``/tmp``, ``/run``, ``/dev/shm`` are
  tmpfs, and ``/usr`` is a read-only overlay of the runtime cache's "Lambda Stack" layer (torch
  for the system python3) over the host's ``/usr``;
* a user ``ubuntu`` (uid 1000) with passwordless sudo, the registered SSH key in
  ``~/.ssh/authorized_keys`` (Lambda writes it; SkyPilot uses no cloud-init), uv and a prebuilt
  ``~/skypilot-runtime``; pip and uv install from the cache's wheelhouse (the nodes' only index).

Not emulated: GPUs (a node has the host's CPUs; catalog GPU counts are only labels: the suite's
jobs say ``trainer.device: cpu``, the product's explicit way to train CPU ranks on a GPU node),
cloud-init,
Lambda's filesystems, real boot times.
"""

from __future__ import annotations

import os
import shutil
import shlex
import signal
import subprocess
import time
from pathlib import Path

from tests.e2e.clouds.lambdalab import runtime

BRIDGE = "dtlab0"
HOST_IP = "10.77.0.1"
PREFIX = 24
NETNS_PREFIX = "dtlab-"
VETH_PREFIX = "dtlv"


def sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, check=check, capture_output=True, text=True)


def node_ip(n: int) -> str:
    return f"10.77.0.{n}"


def bridge_up(bridge: str = BRIDGE, host_ip: str = HOST_IP) -> None:
    if sh(f"ip link show {bridge}", check=False).returncode != 0:
        sh(f"ip link add {bridge} type bridge")
        sh(f"ip addr add {host_ip}/{PREFIX} dev {bridge}")
    sh(f"ip link set {bridge} up")


def bridge_down(bridge: str = BRIDGE) -> None:
    sh(f"ip link del {bridge}", check=False)


INIT = r"""
set -eu
hostname "$NODE_HOST"
mount --make-rprivate /
mount -t tmpfs -o size=8g,mode=755 dtlab-upper /mnt
for d in etc var root home; do mkdir -p /mnt/$d/u /mnt/$d/w; done
mount -t overlay overlay -o "lowerdir=$HOME_LAYER:/home,upperdir=/mnt/home/u,workdir=/mnt/home/w" /home
for d in etc var root; do
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=/mnt/$d/u,workdir=/mnt/$d/w" /$d
done
mount -t overlay overlay -o "ro,lowerdir=$CACHE/usr:/usr" /usr
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=755 tmpfs /run
mount -t tmpfs -o mode=1777,size=2g tmpfs /dev/shm
mkdir -p /run/sshd /run/sudo
# the user Lambda's image has: ubuntu, passwordless sudo
# (uid/gid 1000 may be taken on the host: the node's own /etc gives it to ubuntu)
gone=$(awk -F: '$3 == 1000 || $1 == "ubuntu" {print $1}' /etc/passwd)
for u in $gone; do sed -i "/^$u:/d" /etc/passwd /etc/shadow; done
sed -i -E '/^[^:]*:[^:]*:1000:/d; /^ubuntu:/d' /etc/group
echo 'ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash' >> /etc/passwd
echo 'ubuntu:x:1000:' >> /etc/group
echo 'ubuntu:*:19000:0:99999:7:::' >> /etc/shadow
echo 'ubuntu ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/90-ubuntu
chmod 440 /etc/sudoers.d/90-ubuntu
echo "$NODE_HOST" > /etc/hostname
printf '127.0.0.1 localhost\n%s %s\n' "$NODE_IP" "$NODE_HOST" > /etc/hosts
printf '[global]\nno-index = true\nfind-links = %s/wheelhouse\n' "$CACHE" > /etc/pip.conf
rm -rf /etc/xdg/pip
mkdir -p /etc/uv
printf 'no-index = true\nfind-links = ["%s/wheelhouse"]\npython-downloads = "never"\n' "$CACHE" > /etc/uv/uv.toml
mkdir -p /etc/ssh/sshd_config.d
printf 'UseDNS no\nUsePAM no\nPidFile /run/sshd.pid\nPasswordAuthentication no\n' > /etc/ssh/sshd_config.d/dtlab.conf
install -d -o 1000 -g 1000 -m 700 /home/ubuntu/.ssh
printf '%s\n' "$NODE_PUBKEY" > /home/ubuntu/.ssh/authorized_keys
chown 1000:1000 /home/ubuntu/.ssh/authorized_keys
chmod 600 /home/ubuntu/.ssh/authorized_keys
exec /usr/sbin/sshd -D -e
"""


def home_layer(lab_dir: Path) -> Path:
    """The ubuntu home every node starts from (lower layer of its /home overlay)."""
    layer = lab_dir / "home-layer"
    home = layer / "ubuntu"
    skel = Path("/etc/skel/.bashrc").read_text() if Path("/etc/skel/.bashrc").exists() else ""
    bashrc = "export PATH=\"$HOME/.local/bin:$PATH\"\n" + skel
    if (home / ".bashrc").exists() and (home / ".bashrc").read_text() == bashrc:
        return layer
    if layer.exists():  # an older layer (another .bashrc): made again
        shutil.rmtree(layer)
    (home / ".local" / "bin").mkdir(parents=True, exist_ok=True)
    (home / ".bashrc").write_text(bashrc)
    (home / ".profile").write_text('[ -n "$BASH_VERSION" ] && [ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n')
    os.symlink(runtime.CACHE / "uv", home / ".local" / "bin" / "uv")
    # cp --reflink-free copy would cost 0.7 GB per lab: the overlay's lower layer is the cache's
    # venv itself, reached by a symlink (writes into it land in the node's upper, not the cache)
    os.symlink(runtime.CACHE / "runtime" / "skypilot-runtime", home / "skypilot-runtime")
    sh(f"chown -R -h 1000:1000 {shlex.quote(str(home))}")
    os.chmod(home, 0o755)
    return layer


def up(lab_dir: Path, n: int, pubkey: str, log_path: Path) -> int:
    """Create node ``n`` and start its sshd; returns the host PID of the node's PID 1 (tini)."""
    ns, veth, ip = f"{NETNS_PREFIX}{n}", f"{VETH_PREFIX}{n}", node_ip(n)
    sh(f"ip netns add {ns}")
    sh(f"ip link add {veth} type veth peer name eth0 netns {ns}")
    sh(f"ip link set {veth} master {BRIDGE} up")
    sh(f"ip -n {ns} link set lo up && ip -n {ns} addr add {ip}/{PREFIX} dev eth0 && "
       f"ip -n {ns} link set eth0 up && ip -n {ns} route add default via {HOST_IP}")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "NODE_HOST": f"lambda-{n}", "NODE_IP": ip,
           "NODE_PUBKEY": pubkey, "HOME_LAYER": str(home_layer(lab_dir)), "CACHE": str(runtime.CACHE)}
    with open(log_path, "ab") as log:
        p = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--pid", "--uts", "--fork",
                              "--mount-proc", "--propagation", "private", "tini", "-s", "--",
                              "bash", "-c", INIT], env=env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    return p.pid


def pids_in(ns: str) -> list[int]:
    out = sh(f"ip netns pids {ns}", check=False).stdout.split()
    return [int(x) for x in out if x.isdigit()]


def down(n: int, launcher_pid: int | None = None, netns_prefix: str = NETNS_PREFIX,
         veth_prefix: str = VETH_PREFIX) -> None:
    """Kill everything in node ``n`` (its PID namespace dies with its PID 1), remove its netns.
    (The prefixes: another lab's nodes, e.g. the RunPod lab's.)"""
    ns = f"{netns_prefix}{n}"
    for _ in range(50):
        pids = pids_in(ns)
        if launcher_pid:
            pids.append(launcher_pid)
        alive = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if launcher_pid:
            try:
                os.waitpid(launcher_pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if not pids_in(ns) and not _alive(launcher_pid):
            break
        time.sleep(0.1)
    sh(f"ip link del {veth_prefix}{n}", check=False)
    sh(f"ip netns del {ns}", check=False)


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def all_netns(netns_prefix: str = NETNS_PREFIX) -> list[str]:
    return [line.split()[0] for line in sh("ip netns list", check=False).stdout.splitlines()
            if line.startswith(netns_prefix)]


def ssh_banner(ip: str, timeout: float = 1.0) -> bool:
    import socket

    try:
        with socket.create_connection((ip, 22), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(16).startswith(b"SSH-")
    except OSError:
        return False
