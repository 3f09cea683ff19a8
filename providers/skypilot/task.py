"""The SkyPilot task for one attempt: what ``sky launch`` would read from YAML.

``setup`` installs only what the node lacks, ``run`` is the node bootstrap followed by its exit
code on the last log line (:data:`EXIT_MARKER`, read back by the provider's poll), ``resources``
name the offer's accelerator, spot or not, and where (one ``infra`` or ``ordered`` regions for
SkyPilot's own failover). ``dtrun export --skypilot`` prints the same dict.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from providers.base import LaunchRequest, Offer
from providers.skypilot.clouds import CLOUDS, sky_accelerator

EXIT_MARKER = "DTRUN_EXIT_CODE="
EXIT_RE = re.compile(r"DTRUN_EXIT_CODE=(-?\d+)")
"""Finds the bootstrap's exit code in a job log (the last match counts)."""


def run_script(command: list[str]) -> str:
    """The task's run: the node bootstrap, then its exit code on the last line of the job log."""
    return (f"{shlex.join(command)}\n"
            f"rc=$?\n"
            f'echo "{EXIT_MARKER}$rc"\n'
            f"exit $rc\n")


SETUP = "python infra/node_setup.py"
"""Installs only what the node is missing (torch checked against the pin, then the other
dependencies), then dtrun with --no-deps: seconds on a prebuilt image, minutes on a bare one."""
IMAGE_CLOUDS = ("runpod", "vast")
"""Clouds whose nodes are containers: ``request.image`` becomes ``image_id: docker:<image>``.
Lambda runs VMs (its Lambda Stack image ships PyTorch); the setup step checks it."""


def task_resources(cloud: str, offer: Offer) -> dict[str, Any]:
    """The task's ``resources``: the offer's accelerator (and instance type, which pins the
    variant), spot or not, and where: ``infra: <cloud>`` lets SkyPilot fail over across every
    region that sells it; ``offer.regions`` (a spec's ``resources.regions``) become ``ordered``
    candidates, cheapest first — one launch tries them all (SkyPilot's own failover)."""
    accel = sky_accelerator(cloud, offer.gpu, offer.instance_type)
    res: dict[str, Any] = {"accelerators": f"{accel}:{offer.gpus_per_node}", "use_spot": bool(offer.spot)}
    if offer.instance_type:
        res["instance_type"] = offer.instance_type
    sky = CLOUDS[cloud].sky_name
    regions = list(offer.regions)
    if not regions and offer.region and offer.region not in ("any", ""):
        regions = [offer.region]
    if len(regions) > 1:
        res["ordered"] = [{"infra": f"{sky}/{r}"} for r in regions]
    elif regions:
        res["infra"] = f"{sky}/{regions[0]}"
    else:
        res["infra"] = sky
    return res


def build_task_config(cloud: str, request: LaunchRequest) -> dict[str, Any]:
    """The SkyPilot task dict for one attempt (what ``sky launch`` would read from YAML)."""
    offer = request.offer
    envs = {k: str(v) for k, v in request.env.items()}
    if request.deadline is not None:
        envs.setdefault("DTRUN_DEADLINE", str(int(request.deadline)))
    envs.setdefault("DTRUN_JOB", request.job)
    envs.setdefault("DTRUN_ATTEMPT", str(request.attempt))
    envs.setdefault("DTRUN_NNODES", str(request.nodes))
    cfg: dict[str, Any] = {
        "name": request.instance_name,
        "resources": task_resources(cloud, offer),
        "num_nodes": request.nodes,
        "envs": envs,
        "run": run_script(request.command),
    }
    if request.image and cloud in IMAGE_CLOUDS:
        cfg["resources"]["image_id"] = f"docker:{request.image}"
    if request.workdir:
        cfg["workdir"] = request.workdir
        cfg["setup"] = SETUP
    if request.secrets:
        # SkyPilot's task ``secrets``: set in the node's environment like ``envs``, but redacted
        # in SkyPilot's logs, its cluster records and every YAML it writes.
        cfg["secrets"] = {k: str(v) for k, v in request.secrets.items()}
    if cloud == "vast" and offer.spot and offer.spot_bid:
        # SkyPilot 0.14.1 bids Vast's `min_bid` of the offer its launch search finds, and that
        # search's chunking floors every min_bid to 0 (vastai.utils): it would bid $0. dtrun's
        # quote is the live bid it fetched (providers.skypilot.fetch); SkyPilot places it through
        # the task-level `vast.create_instance_kwargs.price` (USD per instance-hour).
        cfg["config"] = {"vast": {"create_instance_kwargs": {
            "price": round(offer.spot_bid * offer.gpus_per_node, 4)}}}
    return cfg
