"""Whether a RunPod pod SkyPilot 0.14.1 launched is still there, asked of RunPod itself.

An interruptible pod RunPod takes back is ``EXITED`` (then deleted), and 0.14.1's status query
maps only CREATED/RESTARTING/PAUSED/RUNNING (``sky/provision/runpod/instance.py``
``query_instances``): an EXITED pod raises ``KeyError``, the refresh fails and the cluster stays
UP in SkyPilot's table while its node no longer answers SSH (seen on the RunPod lab). Without
this check dtrun could only let the heartbeat bound (minutes) end such an attempt as ``lost``;
with it, the first poll that finds the node unreachable asks RunPod for the pod (GraphQL
``myself { pods }``, as the runpod SDK sends it, through the SDK's own query function: the key
SkyPilot reads, ``RUNPOD_API_BASE_URL`` honoured) and an EXITED or vanished pod is a preemption
at once.

The pod is the one SkyPilot named ``<cluster name on cloud>-head`` (``sky/provision/runpod/
instance.py``); a cluster whose name on the cloud is not known is not checked.
"""

from __future__ import annotations

from typing import Any

PODS_QUERY = """
query myself {
    myself {
        pods {
            id
            name
            desiredStatus
            podType
        }
    }
}
"""
GONE = ("EXITED", "TERMINATED")
"""``desiredStatus`` values of a pod that no longer runs its container (RunPod's PodStatus)."""


def head_pod(name_on_cloud: str, key: str) -> dict[str, Any] | None:
    """RunPod's row for the head pod of ``name_on_cloud`` (``id``, ``name``, ``desiredStatus``,
    ``podType``), or None when RunPod lists no such pod. Raises on an API or network fault."""
    from runpod.api.graphql import run_graphql_query

    data = run_graphql_query(PODS_QUERY, api_key=key)
    pods = ((data.get("data") or {}).get("myself") or {}).get("pods") or []
    name = f"{name_on_cloud}-head"
    return next((p for p in pods if p.get("name") == name), None)


def taken_back(row: dict[str, Any] | None) -> str | None:
    """Why the pod is gone (for the log), or None while RunPod says it runs."""
    if row is None:
        return "RunPod no longer lists the pod"
    status = str(row.get("desiredStatus") or "")
    if status in GONE:
        kind = "interruptible pod" if row.get("podType") == "INTERRUPTABLE" else "pod"
        return f"RunPod reports the {kind} {row.get('id')} {status}"
    return None
