"""RunPod, Lambda and Vast through SkyPilot (0.14.1).

One attempt = one SkyPilot cluster named ``request.instance_name`` (``dtrun-<job>-a<N>``):

* **Task** (:func:`build_task_config`): ``setup`` (``infra/node_setup.py``) installs only what
  the node lacks, then the project (synced as ``workdir``) with --no-deps; RunPod/Vast nodes run
  ``request.image`` (``image_id: docker:<image>``: Python and the pinned torch preinstalled),
  ``run`` is the node bootstrap (it echoes ``DTRUN_EXIT_CODE=<rc>`` as its last line so a FAILED
  job can still be told apart from a clean "resume me" exit 75/76), ``envs`` = the request's env
  plus ``DTRUN_DEADLINE``, ``resources = {accelerators: "H100:8", use_spot, infra:
  "<cloud>[/<region>]"}``, ``num_nodes``, ``secrets`` = the request's secrets (the AWS keys for an
  ``s3://`` run URI; SkyPilot redacts task secrets wherever it logs or stores the task; dtrun
  keeps the task dict in memory only). Every generated task is validated with SkyPilot's own
  ``sky.Task.from_yaml_config`` (``dtrun export --skypilot`` prints the same dict).
* **Launch**: ``sky.launch(..., down=True, idle_minutes_to_autostop=N)`` — the cluster removes
  itself N minutes after its job ends, with or without a controller; the node bootstrap's
  watchdog enforces the hard deadline and the budget (SkyPilot has no provider-side timeout).
  ``launch`` blocks until SkyPilot has submitted the job (provisioning takes minutes).
* **Poll**: ``sky.status(refresh)`` then the job queue. Cluster UP → the job's status (PENDING /
  RUNNING / SUCCEEDED / FAILED, with exit 75/76 → PREEMPTED); cluster gone, STOPPED, or back in
  INIT after it was up → PREEMPTED, unless dtrun took it down (TERMINATED) or its job had
  already ended (that outcome: ``down=True`` removes clusters after their job). The last job
  status seen is remembered in ``$DTRUN_HOME/skypilot/clusters.json`` for other processes.
* **Terminate**: ``sky.down``; a cluster that does not exist is fine; confirmed by status.
* **list_owned**: clusters of this cloud whose name starts with the prefix.

Every SDK call goes through :class:`providers.skypilot.api.SkyAPI` (tests pass a recorded fake).
Credentials are checked from each cloud's standard place before anything is rented; the
message names what to set and never contains a secret.

Modules: ``clouds`` (per-cloud facts), ``task`` (the task dict), ``errors`` (SkyPilot's
exceptions → ``providers.errors``), ``provider`` (:class:`SkyPilotProvider`), ``api`` (the SDK
seam), ``credentials``, ``catalog`` (SkyPilot's catalogs as price rows), ``prices`` and
``fetch`` (live prices). They import ``providers.base``/``errors``/``pricing`` and
``orchestrator.contract``, never ``providers.catalog`` (which imports them).
"""

from __future__ import annotations

from providers.skypilot.api import ClusterRecord, JobRecord, SkyAPI
from providers.skypilot.clouds import CLOUDS, CloudInfo, sky_accelerator
from providers.skypilot.errors import ERROR_TABLE, HALF_DEAD, clean, map_sky_error
from providers.skypilot.provider import CLUSTER_STATES, JOB_STATES, SkyPilotProvider
from providers.skypilot.task import SETUP, build_task_config, run_script, task_resources

__all__ = ["SkyPilotProvider", "SkyAPI", "ClusterRecord", "JobRecord", "build_task_config", "map_sky_error",
           "CLOUDS", "CloudInfo", "run_script", "task_resources", "sky_accelerator", "ERROR_TABLE",
           "CLUSTER_STATES", "JOB_STATES", "SETUP", "HALF_DEAD", "clean"]
