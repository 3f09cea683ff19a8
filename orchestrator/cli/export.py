"""``dtrun export JOB --skypilot``: the job as a SkyPilot task YAML a user can ``sky launch`` alone.

The task is the one the SkyPilot adapter launches (``providers.skypilot.build_task_config``),
with ``resources.any_of`` listing every offer dtrun would rent on the SkyPilot clouds in
``resources.providers`` (spot/multi-node capabilities applied; ``spot: prefer`` lists spot and
on-demand; each GPU variant with its accelerator and instance type; ``resources.regions`` as
one candidate per region name SkyPilot's optimizer accepts), so SkyPilot's optimizer picks the
cheapest. The resolved job spec travels in ``DTRUN_JOB_YAML``:
``setup`` writes it to ``<run-uri>/job.yaml`` when absent, which is where the node bootstrap
reads it. The output is validated with ``sky.Task.from_yaml_config`` before it is printed.

Nothing secret is ever included: for an ``s3://`` run URI or data the task lists the AWS keys
under ``secrets:`` with no value (SkyPilot's form for "supplied at launch"), filled by
``sky launch --secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY`` from the user's
environment, as the header says.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from orchestrator.cli.options import JobArg
from orchestrator.contract import nodeenv, runuri
from orchestrator.contract.errors import NoOfferError, UsageError

if TYPE_CHECKING:  # pydantic and the presets load only when a command runs
    from orchestrator.plan.spec import JobSpec

SKYPILOT_CLOUDS = ("runpod", "lambda", "vast")

WRITE_JOB_YAML = (
    'python -c "import os; from orchestrator.contract import runuri; '
    f"u = runuri.join(os.environ['{nodeenv.RUN_URI}'], '{runuri.JOB_FILE}'); "
    f"runuri.exists(u) or runuri.write_text(u, os.environ['{nodeenv.JOB_YAML}'])\""
)


def skypilot_task(spec: JobSpec, workdir: str = ".") -> tuple[dict[str, Any], list[str]]:
    """(task dict, notes) for ``spec``. Raises NoOfferError if no listed SkyPilot cloud can run it."""
    from orchestrator.plan.spec import spec_to_yaml
    from providers.base import LaunchRequest, Offer, Requirements
    from providers.skypilot import CLOUDS, SETUP, build_task_config

    r = spec.resources
    req = Requirements(gpu=r.gpu, gpus_per_node=r.gpus_per_node, nodes=r.nodes, spot=r.spot,
                       regions=tuple(r.regions), max_price_per_gpu_hour=r.max_price_per_gpu_hour)
    notes: list[str] = []
    any_of: list[dict[str, Any]] = []
    from providers.skypilot import SkyPilotProvider, task_resources

    for cloud in [p for p in r.providers if p in SKYPILOT_CLOUDS]:
        prov = SkyPilotProvider(cloud)
        why = prov.refuse(req)
        if why:
            notes.append(f"left out: {why}")
            continue
        caps = CLOUDS[cloud].capabilities
        if r.spot in (True, "prefer") and not caps.spot.supported:
            notes.append(f"{cloud}: on-demand only ({caps.spot.reason})")
        offers = prov.offers(req)
        if not offers:
            notes.append(f"left out: {cloud} has no {r.gpu}×{r.gpus_per_node} offer"
                         + (f" in {', '.join(r.regions)}" if r.regions else ""))
        from orchestrator.plan.estimate import node_image

        img = node_image(spec, cloud)  # RunPod/Vast containers: the prebuilt image
        for offer in offers:
            # One candidate per allowed region, each a name SkyPilot's optimizer accepts (its
            # catalog's, or the snapshot's dated list); none asked for: the whole cloud.
            res = task_resources(cloud, offer)
            if img:
                res["image_id"] = f"docker:{img}"
            ordered = res.pop("ordered", None)
            if ordered:
                for cand in ordered:
                    any_of.append({**res, **cand})
            else:
                any_of.append(res)
    others = [p for p in r.providers if p not in SKYPILOT_CLOUDS]
    if others:
        notes.append(f"not exportable to SkyPilot: {', '.join(others)} (dtrun launches those itself)")
    if not any_of:
        raise NoOfferError(
            f"job {spec.name!r}: none of its providers ({', '.join(r.providers)}) can be exported to "
            f"SkyPilot" + (f" ({'; '.join(notes)})" if notes else "") +
            f"; SkyPilot clouds: {', '.join(SKYPILOT_CLOUDS)}")

    first = any_of[0]
    offer = Offer(first["infra"].split("/")[0], "any", r.gpu, r.gpus_per_node, first["use_spot"], 0.0,
                  nodes=r.nodes)
    price = _max_price(req, [a["infra"].split("/")[0] for a in any_of]) if spec.budget.max_usd is not None else None
    if price is not None:
        notes.append(f"DTRUN_PRICE_PER_HOUR is the highest catalog price of the listed options "
                     f"(${price:.2f}/GPU-h): the node's budget watchdog errs on the safe side")
    if spec.budget.max_hours is not None:
        notes.append(f"budget.max_hours ({spec.budget.max_hours:g} h) is not enforced on the node: its deadline "
                     f"is an absolute time set by dtrun at launch (add --env DTRUN_DEADLINE=<unix time>)")
    # The controller's builder, for attempt 1 with nothing spent; no launch time (the node counts
    # from its own start) and no deadline (absolute, set at launch); the spec travels along.
    env = nodeenv.to_env(nodeenv.for_launch(
        run_uri=spec.run_uri, job=spec.name, attempt=1, gpus_per_node=r.gpus_per_node, nodes=r.nodes,
        idle_minutes=spec.teardown.idle_minutes,
        price_per_hour=None if price is None else price * r.gpus_per_node, max_usd=spec.budget.max_usd,
        controller_lost_minutes=spec.teardown.controller_lost_minutes, job_yaml=spec_to_yaml(spec)))
    req_launch = LaunchRequest(job=spec.name, attempt=1, offer=offer, nodes=r.nodes,
                               command=nodeenv.bootstrap_command(), env=env, workdir=workdir)
    cfg = build_task_config(offer.provider, req_launch)
    cfg["name"] = f"dtrun-{spec.name}"
    cfg["resources"] = {"any_of": any_of}
    cfg["setup"] = f"{SETUP}\n{WRITE_JOB_YAML}"
    from orchestrator.run.nodecreds import ACCESS_KEY, SECRET_KEY, s3_uses

    if s3_uses(spec):
        # No value: SkyPilot takes it from `sky launch --secret KEY` (the local environment's KEY).
        cfg["secrets"] = {ACCESS_KEY: None, SECRET_KEY: None}
    return cfg, notes


def _max_price(req: Any, clouds: list[str]) -> float | None:
    try:
        from providers.catalog import catalog_offers
    except ImportError:
        return None
    prices = [o.price_per_gpu_hour for c in dict.fromkeys(clouds) for o in catalog_offers(c, req)]
    return max(prices) if prices else None


def render_yaml(cfg: dict[str, Any], notes: list[str], spec: JobSpec, validated: bool) -> str:
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)

    _Dumper.add_representer(str, _str)
    head = [f"# SkyPilot task for dtrun job {spec.name!r} — `sky launch -c dtrun-{spec.name} <this file> "
            f"--down -i 3` from the project root.",
            "# The node bootstrap enforces the budget and deadline; the cluster removes itself after the job.",
            "# No secrets here: for an s3:// run URI or data, `secrets:` lists the AWS keys with no value;",
            "# pass them at launch from your environment (SkyPilot redacts them in its logs):",
            "#   sky launch ... --secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY",
            "# (plus --secret AWS_SESSION_TOKEN for temporary keys, and AWS_ENDPOINT_URL /",
            "# AWS_DEFAULT_REGION with --env if your bucket needs them)."]
    head += [f"# note: {n}" for n in notes]
    if not validated:
        head.append("# NOT validated: SkyPilot is not installed here (pip install 'dtrun[skypilot]').")
    return "\n".join(head) + "\n" + yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, width=100)


def cmd_export(job: Path, skypilot: bool) -> int:
    if not skypilot:
        raise UsageError("choose what to export: --skypilot (the SkyPilot task YAML)")
    from orchestrator.plan.spec import load_spec

    spec = load_spec(job)
    if spec.command is not None:  # its nodes unpack <run-uri>/code.tar.gz, which only `dtrun up` packs
        raise UsageError(f"{job}: runs your own command, whose code reaches its nodes as "
                         f"{spec.run_uri}/code.tar.gz, packed by `dtrun up` before the launch: a task exported "
                         "for a plain `sky launch` would find no code. Run it with `dtrun up`")
    cfg, notes = skypilot_task(spec)
    validated = True
    try:
        from providers.skypilot.api import task_from_config
    except ImportError:  # pragma: no cover - the skypilot extra is part of the dev install
        validated = False
    else:
        try:
            task_from_config(cfg)
        except ImportError:
            validated = False
        except Exception as e:  # SkyPilot's own validation: a bug in dtrun if it ever fires
            raise UsageError(f"{job}: SkyPilot rejected the generated task: {e}") from None
    sys.stdout.write(render_yaml(cfg, notes, spec, validated))
    sys.stdout.flush()
    return 0

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def export(
    job: JobArg,
    skypilot: Annotated[bool, typer.Option("--skypilot", help="Print the SkyPilot task YAML.")] = False,
) -> None:
    """Print the job as another tool's config (no secrets included)."""
    raise typer.Exit(cmd_export(job, skypilot=skypilot))
