"""One RunPod lab pod: a "container" made of namespaces, its SSH on a mapped public port.

What a pod is here, against what RunPod hands out:

* **no container runtime.** The image is this host's root filesystem under a per-pod writable
  overlay (upper on a tmpfs that dies with the pod), entered with ``chroot``: whatever
  ``imageName`` says, every pod gets the same "image". Its contents: Debian 12 with
  openssh-server, rsync, curl, patch and sudo already installed (so SkyPilot's init's
  ``apt install`` writes nothing), ``/usr`` a per-pod writable overlay of ``python``/``pip``
  links (the PyTorch image has both on PATH) and the runtime cache's torch layer over the host's
  (Debian's python3 plays the image's python; ``PIP_BREAK_SYSTEM_PACKAGES=1`` in the image's
  environment lets its pip install into it, as conda's pip would), and ``/root`` a clean per-pod layer holding ``.bashrc``/``.profile``
  from ``/etc/skel``, ``~/.local/bin/uv`` and a prebuilt ``~/skypilot-runtime`` (SkyPilot 0.14.1
  would download CPython when it is missing: the nodes have no internet). ``/home``, the
  repository and the lab's own directory (its HOME and keys) are hidden (empty tmpfs).
* **the main process is ``dockerArgs``** (``shlex.split``, cwd ``/``, under tini as PID 1 of
  the pod's PID namespace), with the environment RunPod gives a pod (``RUNPOD_POD_ID``,
  ``RUNPOD_PUBLIC_IP``, ``RUNPOD_TCP_PORT_22``, ``PUBLIC_KEY`` = the account's ``pubKey``, the
  mutation's ``env``), never the host's. SkyPilot's init script starts sshd itself
  (``service ssh restart``); nothing else starts it.
* **network:** netns ``dtrp-<n>`` with ``eth0`` = ``10.78.0.<n>`` on the bridge ``dtrp0``
  (host end ``10.78.0.1``; the host does not forward, so nothing leaves the machine). The
  "public" SSH endpoint is ``10.78.0.1:<20000+n>``, a TCP forwarder in the API process to
  ``10.78.0.<n>:22`` — not port 22, as on RunPod. ``/etc/resolv.conf`` is ``nameserver
  127.0.0.1``, no package lists and ``Acquire::Retries 0`` (``apt update`` fails at once
  instead of retrying; ``apt install`` of what is installed is then a no-op).

Not emulated: GPUs (labels only), RunPod's HTTP proxy (``*.proxy.runpod.net``), network volumes,
container disk size limits, real image pulls and boot times.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.clouds.lambdalab import node as lnode
from tests.e2e.clouds.lambdalab import runtime

BRIDGE = "dtrp0"
HOST_IP = "10.78.0.1"
NETNS_PREFIX = "dtrp-"
VETH_PREFIX = "dtrpv"
PORT_BASE = 20000  # under Linux's ephemeral range (32768–60999): an outgoing connection's local port on the bridge address never holds it
REPO = Path(__file__).resolve().parents[4]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def pod_ip(n: int) -> str:
    return f"10.78.0.{n}"


@dataclass(frozen=True)
class Net:
    """Where a lab's pods live: netns/veth prefixes, bridge, its host address, a pod's address
    (another lab, e.g. the Vast lab, has its own and passes them to :func:`up`)."""

    netns_prefix: str
    veth_prefix: str
    bridge: str
    host_ip: str
    subnet: str  # "10.78.0": pod n is <subnet>.<n>

    def ip(self, n: int) -> str:
        return f"{self.subnet}.{n}"


RUNPOD = Net(NETNS_PREFIX, VETH_PREFIX, BRIDGE, HOST_IP, "10.78.0")


def ssh_port(n: int) -> int:
    return PORT_BASE + n


def bridge_up() -> None:
    lnode.bridge_up(BRIDGE, HOST_IP)


SYSTEM_DIRS = {Path(p) for p in ("/", "/tmp", "/var", "/var/lib", "/usr", "/opt", "/home", "/root", "/srv", "/mnt", "/run", "/etc")}


def hidden_dirs(lab_dir: Path) -> list[Path]:
    """What a pod must not see of the host, each covered by an empty 1 MB tmpfs: the repository
    and the lab's directory, each with its parent (its checkouts and keys beside it) unless the
    parent is a system directory (a checkout at ``/tmp/ci``: a 1 MB ``/tmp`` would fill at the
    first pip build)."""
    out: list[Path] = []
    for d in (REPO, lab_dir):
        d = d.parent if d.parent not in SYSTEM_DIRS else d
        if d not in out:
            out.append(d)
    return out


def bridge_down() -> None:
    lnode.bridge_down(BRIDGE)


def all_netns() -> list[str]:
    return lnode.all_netns(NETNS_PREFIX)


INIT = r"""
set -eu
hostname "$POD_HOST"
mount --make-rprivate /
B="$POD_DIR"
mkdir -p "$B"
mount -t tmpfs -o size=8g,mode=755 dtrp-upper "$B"
mkdir -p "$B/u" "$B/w" "$B/ru" "$B/rw" "$B/new"
R="$B/new"
mount -t overlay overlay -o "lowerdir=/,upperdir=$B/u,workdir=$B/w" "$R"
mkdir -p "$B/uu" "$B/uw"
mount -t overlay overlay -o "lowerdir=$IMAGE_USR:$CACHE/usr:/usr,upperdir=$B/uu,workdir=$B/uw" "$R/usr"
mount -t overlay overlay -o "lowerdir=$ROOT_LAYER,upperdir=$B/ru,workdir=$B/rw" "$R/root"
chmod 700 "$R/root"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
mount --rbind /dev "$R/dev"
mount -t tmpfs -o mode=1777,size=2g tmpfs "$R/dev/shm"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
mount -t tmpfs -o mode=755 tmpfs "$R/run"
mount -t tmpfs -o mode=755 tmpfs "$R/home"
for d in $HIDE; do [ -d "$R$d" ] && mount -t tmpfs -o mode=755,size=1m tmpfs "$R$d"; done
E="$R/etc"
echo "$POD_HOST" > "$E/hostname"
printf '127.0.0.1 localhost\n%s %s\n' "$POD_IP" "$POD_HOST" > "$E/hosts"
rm -f "$E/resolv.conf"; echo 'nameserver 127.0.0.1' > "$E/resolv.conf"
printf '[global]\nno-index = true\nfind-links =\n    %s/wheelhouse\n    %s\n' "$CACHE" "$EXTRA_WHEELS" > "$E/pip.conf"
rm -rf "$E/xdg/pip"
mkdir -p "$E/uv"
printf 'no-index = true\nfind-links = ["%s/wheelhouse", "%s"]\npython-downloads = "never"\n' "$CACHE" "$EXTRA_WHEELS" > "$E/uv/uv.toml"
mkdir -p "$E/ssh/sshd_config.d"
printf 'UseDNS no\nUsePAM no\nPidFile /run/sshd.pid\nPasswordAuthentication no\n' > "$E/ssh/sshd_config.d/dtlab.conf"
rm -f "$E/ssh/ssh_host_"*   # the image's host keys: made by the pod's own `ssh-keygen -A`
rm -rf "$R/var/lib/apt/lists/"*   # the image ships no package lists (its packages are current)
printf 'Acquire::Retries "0";\n' > "$E/apt/apt.conf.d/99dtrp-offline"
exec chroot "$R" "$@"
"""


def image_usr(lab_dir: Path) -> Path:
    """The top /usr layer of the "image": ``python`` and ``pip`` on PATH, as the PyTorch image has them."""
    layer = lab_dir / "image-usr"
    if not (layer / "local" / "bin" / "python").exists():
        (layer / "local" / "bin").mkdir(parents=True, exist_ok=True)
        os.symlink("/usr/bin/python3", layer / "local" / "bin" / "python")
        os.symlink("/usr/bin/pip3", layer / "local" / "bin" / "pip")
    return layer


def root_layer(lab_dir: Path) -> Path:
    """The /root every pod starts from (the "image's" root home)."""
    layer = lab_dir / "root-layer"
    if (layer / ".profile").exists():
        return layer
    (layer / ".local" / "bin").mkdir(parents=True, exist_ok=True)
    skel = Path("/etc/skel/.bashrc").read_text() if Path("/etc/skel/.bashrc").exists() else ""
    (layer / ".bashrc").write_text('export PATH="$HOME/.local/bin:$PATH"\n' + skel)
    (layer / ".profile").write_text('[ -n "$BASH_VERSION" ] && [ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n')
    os.symlink(runtime.CACHE / "uv", layer / ".local" / "bin" / "uv")
    # the cache's venv, reached by a symlink: writes land in the pod's /var upper, not the cache
    os.symlink(runtime.CACHE / "runtime" / "skypilot-runtime", layer / "skypilot-runtime")
    os.chmod(layer, 0o700)
    return layer


def up(lab_dir: Path, n: int, pod_id: str, docker_args: str, env: dict[str, str], log_path: Path,
       net: Net = RUNPOD, wheels: str = "runpod", stdin: bytes | None = None) -> int:
    """Create pod ``n`` and start its main process (``dockerArgs``); returns the launcher's PID.
    ``net``/``wheels`` (the cache's ``<wheels>/wheelhouse`` beside the shared one): another lab's;
    ``stdin``: written to the main process's standard input (then closed)."""
    ns, veth, ip = f"{net.netns_prefix}{n}", f"{net.veth_prefix}{n}", net.ip(n)
    lnode.sh(f"ip netns add {ns}")
    lnode.sh(f"ip link add {veth} type veth peer name eth0 netns {ns}")
    lnode.sh(f"ip link set {veth} master {net.bridge} up")
    lnode.sh(f"ip -n {ns} link set lo up && ip -n {ns} addr add {ip}/24 dev eth0 && "
             f"ip -n {ns} link set eth0 up && ip -n {ns} route add default via {net.host_ip}")
    pod_dir = lab_dir / "pods" / str(n)
    pod_dir.mkdir(parents=True, exist_ok=True)
    hide = " ".join(shlex.quote(str(p)) for p in hidden_dirs(lab_dir))
    init_env = {"PATH": PATH, "POD_HOST": pod_id, "POD_IP": ip, "POD_DIR": str(pod_dir),
                "ROOT_LAYER": str(root_layer(lab_dir)), "IMAGE_USR": str(image_usr(lab_dir)), "CACHE": str(runtime.CACHE), "HIDE": hide,
                "EXTRA_WHEELS": str(runtime.CACHE / wheels / "wheelhouse")}
    pod_env = {"HOME": "/root", "PATH": PATH, "LANG": "C.UTF-8", "HOSTNAME": pod_id,
               "PIP_BREAK_SYSTEM_PACKAGES": "1", **env}  # the image's pip installs into its python
    argv = ["/usr/bin/tini", "-s", "--", "/usr/bin/env", "-i",
            *[f"{k}={v}" for k, v in pod_env.items()], *shlex.split(docker_args or "sleep infinity")]
    with open(log_path, "ab") as log:
        p = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--pid", "--uts", "--fork",
                              "--mount-proc", "--propagation", "private", "bash", "-c", INIT, "init", *argv],
                             env=init_env, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
    if stdin is not None:
        p.stdin.write(stdin)
        p.stdin.close()
    return p.pid


def down(lab_dir: Path, n: int, launcher_pid: int | None = None) -> None:
    """Kill every process of pod ``n``, remove its netns and veth (its tmpfs dies with its mount ns)."""
    lnode.down(n, launcher_pid, NETNS_PREFIX, VETH_PREFIX)
    shutil.rmtree(lab_dir / "pods" / str(n), ignore_errors=True)


class Forwarder:
    """``HOST_IP:port`` → ``target:22``: RunPod's public port mapping for a pod's SSH."""

    def __init__(self, port: int, target: str, host: str = HOST_IP):
        self.target = target
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.conns: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection((self.target, 22), timeout=5)
                u.settimeout(None)
            except OSError:
                c.close()  # the pod's sshd is not up (yet): connection closed, as RunPod's proxy does
                continue
            self.conns += [c, u]
            threading.Thread(target=self._pump, args=(c, u), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        for s in [self.sock, *self.conns]:
            try:
                s.close()
            except OSError:
                pass
