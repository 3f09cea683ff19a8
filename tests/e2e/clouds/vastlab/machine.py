"""One Vast lab instance: the RunPod lab's namespaced "container" (:mod:`tests.e2e.clouds.runpodlab.pod`:
the host's root under a per-instance overlay, chroot, a clean ``/root`` with SkyPilot's runtime at
``/root/skypilot-runtime``, tini as PID 1) on the Vast lab's own bridge, started the way Vast
starts an instance: sshd (daemonized), the account's SSH keys in ``/root/.ssh/authorized_keys``,
then the instance's ``onstart`` (saved as ``/root/onstart.sh``, run with bash; that is how
SkyPilot's key and ``~/.vast_api_key`` get in), then ``sleep infinity``. The create body's ``env``
is the environment of those processes (not of SSH logins: nothing writes ``/etc/environment``).

* network: netns ``dtvs-<n>``, ``eth0`` = ``10.79.0.<n>`` on the bridge ``dtvs0`` (host end
  ``10.79.0.1``; nothing leaves the machine). SSH: ``10.79.0.1:<22000+n>``, a forwarder in the API
  process to ``10.79.0.<n>:22`` (Vast's proxy port: not 22).
* the image: whatever ``image`` says, the host's Debian 12 as the RunPod lab's pods have it;
  pip/uv install from the runtime cache's wheelhouse and ``vast/wheelhouse`` (SkyPilot installs its
  wheel as ``[vast, remote]``), and the image's pip installs into its python (``break-system-packages``
  in ``/etc/pip.conf``: every SSH login too, as a conda image's pip would; the RunPod lab gets the
  same from the environment RunPod's init freezes into logins, which Vast has no equivalent of).

Not emulated: Docker (no image is pulled, ``extra``/``args``/``runtype`` are ignored), GPUs (labels
only), a stopped instance's disk (a restart boots a fresh root and runs ``onstart`` again, where
Vast keeps the container's disk), Vast's ``/.launch`` entrypoint and its tmux.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from tests.e2e.clouds.lambdalab import node as lnode
from tests.e2e.clouds.runpodlab import pod as podlib

NET = podlib.Net(netns_prefix="dtvs-", veth_prefix="dtvsv", bridge="dtvs0", host_ip="10.79.0.1", subnet="10.79.0")
PORT_BASE = 22000  # under the ephemeral range, as the RunPod lab's

MAIN = r"""
cat > /root/onstart.sh
printf 'break-system-packages = true\n' >> /etc/pip.conf  # the image's pip installs into its python, as conda's would
mkdir -p /run/sshd /root/.ssh && chmod 700 /root/.ssh
printf '%s\n' "$VAST_LAB_ACCOUNT_KEYS" >> /root/.ssh/authorized_keys && chmod 600 /root/.ssh/authorized_keys
ssh-keygen -A >/dev/null 2>&1
/usr/sbin/sshd
cd /root && bash /root/onstart.sh > /var/log/onstart.log 2>&1
exec sleep infinity
"""


def ssh_port(n: int) -> int:
    return PORT_BASE + n


def bridge_up() -> None:
    lnode.bridge_up(NET.bridge, NET.host_ip)


def bridge_down() -> None:
    lnode.bridge_down(NET.bridge)


def all_netns() -> list[str]:
    return lnode.all_netns(NET.netns_prefix)


class Machine:
    """A running instance: its namespaces, main process and SSH forwarder."""

    def __init__(self, lab_dir: Path, n: int, instance_id: int, onstart: str, env: dict[str, str],
                 account_keys: list[str]):
        self.lab_dir, self.n = lab_dir, n
        self.ssh_port = ssh_port(n)
        self.fwd = podlib.Forwarder(self.ssh_port, NET.ip(n), host=NET.host_ip)
        pod_env = {"CONTAINER_ID": str(instance_id), "VAST_CONTAINERLABEL": f"C.{instance_id}",
                   "PUBLIC_IPADDR": NET.host_ip, "VAST_TCP_PORT_22": str(self.ssh_port),
                   "VAST_LAB_ACCOUNT_KEYS": "\n".join(account_keys), **{k: str(v) for k, v in env.items()}}
        try:
            self.pid = podlib.up(lab_dir, n, f"C.{instance_id}", shlex.join(["bash", "-c", MAIN]), pod_env,
                                 lab_dir / "nodes" / f"{n}.log", net=NET, wheels="vast", stdin=onstart.encode())
        except Exception:
            self.fwd.close()
            lnode.down(n, None, NET.netns_prefix, NET.veth_prefix)
            raise

    def down(self) -> None:
        self.fwd.close()
        down(self.lab_dir, self.n, self.pid)


def down(lab_dir: Path, n: int, launcher_pid: int | None = None) -> None:
    """Kill every process of instance ``n``, remove its netns and veth (its tmpfs dies with it)."""
    lnode.down(n, launcher_pid, NET.netns_prefix, NET.veth_prefix)
    shutil.rmtree(lab_dir / "pods" / str(n), ignore_errors=True)
