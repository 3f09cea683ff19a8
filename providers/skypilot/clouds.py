"""Per-cloud facts for the SkyPilot clouds (RunPod, Lambda, Vast): what dtrun's GPU names are
called there, what each cloud can do (spot, multi-node, GPUs per node, each with its reason) and
the one file SkyPilot reads its key from. Plain data: nothing here calls SkyPilot."""

from __future__ import annotations

import re
from dataclasses import dataclass

from providers.base import Capabilities, Capability
from providers.skypilot import credentials

# dtrun GPU → SkyPilot accelerator name per cloud, where it is not the same name. A variant a
# cloud names by instance type only (Lambda/Vast H100) also needs the offer's instance type.
SKY_ACCELERATORS: dict[str, dict[str, str]] = {
    "runpod": {"H100-PCIe": "H100", "H100-SXM": "H100-SXM"},
    "lambda": {"H100-PCIe": "H100", "H100-SXM": "H100"},
    "vast": {"H100-PCIe": "H100", "H100-SXM": "H100", "A100-80GB": "A100"},
}
_RUNPOD_TYPE = re.compile(r"^\d+x_(.+)_(SECURE|COMMUNITY)$")


def sky_accelerator(cloud: str, gpu: str, instance_type: str | None = None) -> str:
    """SkyPilot's accelerator name for dtrun's ``gpu`` on ``cloud`` (RunPod's instance types
    spell it: ``8x_H100-SXM_SECURE`` → ``H100-SXM``)."""
    if cloud == "runpod" and instance_type:
        m = _RUNPOD_TYPE.match(instance_type)
        if m:
            return m.group(1)
    return SKY_ACCELERATORS.get(cloud, {}).get(gpu, gpu)


@dataclass(frozen=True)
class CloudInfo:
    name: str
    sky_name: str
    capabilities: Capabilities
    credential_file: str
    """The one file SkyPilot reads this cloud's key from (``providers.skypilot.credentials``)."""


CLOUDS: dict[str, CloudInfo] = {
    "runpod": CloudInfo(
        "runpod", "runpod",
        Capabilities(
            spot=Capability(True, "interruptible pods (RunPod dropped spot from its docs in May 2026: may not be sold)"),
            multi_node=Capability(False, "SkyPilot: multi-node is not supported on RunPod (no interconnect between pods)"),
            max_gpus_per_node=8,
        ),
        credentials.RUNPOD_FILE,
    ),
    "lambda": CloudInfo(
        "lambda", "lambda",
        Capabilities(
            spot=Capability(False, "Lambda sells no spot/interruptible capacity"),
            multi_node=Capability(True),
            max_gpus_per_node=8,
        ),
        credentials.LAMBDA_FILE,
    ),
    "vast": CloudInfo(
        "vast", "vast",
        Capabilities(
            spot=Capability(True, "interruptible bids: outbid → stopped with no notice"),
            multi_node=Capability(False, "SkyPilot: multi-node is not supported on Vast"),
            max_gpus_per_node=8,
        ),
        credentials.VAST_FILE,
    ),
}


