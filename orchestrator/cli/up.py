"""``dtrun up`` and its ``--dry-run``: what fits, what it costs, whether it fits the budget, then
(without ``--dry-run``) the run itself; and ``dtrun schema``. The plan is made once
(``orchestrator.run.prepare``) and shown (``orchestrator.cli.planview``); ``dtrun up`` hands that
same plan to the controller, here (``orchestrator.cli.foreground``) or detached
(``orchestrator.cli.detached``). The dry run rents nothing and imports neither torch nor sky nor
boto3; the real run imports the controller when it starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.foreground import run_foreground
from orchestrator.cli.options import JobArg, JsonOpt
from orchestrator.cli.planview import (
    FORCE_WARNING,
    ON_THIS_MACHINE,
    json_default,
    plan_report,
    print_plan,
    print_refusals,
    refusal,
    verdict_exit_code,
)
from orchestrator.cli.prices import refresh_prices
from orchestrator.contract.errors import EXIT_INVALID, EXIT_OK, EXIT_PROVIDER


def check_run_uri_reachable(spec, plan, source: str) -> None:
    """The run URI is the only channel between controller and nodes: a rented node cannot reach
    this machine's disk (it would fail to read job.yaml after provisioning was paid for)."""
    if not spec.run_uri.startswith("file://"):
        return
    remote = sorted({o.provider for o in plan.offers if o.provider not in ON_THIS_MACHINE})
    if remote:
        from orchestrator.contract.errors import SpecError

        raise SpecError(f"{source}: checkpoint.uri {spec.checkpoint.uri!r} is on this machine's disk, which "
                        f"nodes rented on {', '.join(remote)} cannot reach; use an s3:// run URI "
                        "(e.g. checkpoint.uri: s3://my-bucket/dtrun/{name}); nothing rented")


def cmd_dry_run(job: Path, json_out: bool, strict: bool = False, force: bool = False) -> int:
    from orchestrator.plan.spec import load_spec
    from orchestrator.run.datacheck import check_data_vocab
    from orchestrator.run.prepare import prepare
    from orchestrator.run.uricheck import check_offline, check_s3_credentials_offline

    spec = load_spec(job)
    check_offline(spec, str(job))  # malformed, unusable scheme, unwritable run folder, no shards: exit 6
    check_data_vocab(spec, str(job), remote=False)
    refreshed = refresh_prices(list(spec.resources.providers), stale_only=True)
    plan = prepare(spec).plan  # what `dtrun up` would confirm: planned on the spec the nodes run
    check_run_uri_reachable(spec, plan, str(job))
    report = plan_report(spec, plan)
    report["price_refresh"] = refreshed
    code = verdict_exit_code(spec, plan, report, strict, force)
    if code == EXIT_OK and plan.chosen is not None:
        # What `dtrun up` refuses next (exit 5 for rented nodes, 6 here), without the network.
        check_s3_credentials_offline(spec, plan.chosen.provider, str(job))
    if force and report.get("does_not_fit"):
        report["warnings"] = [FORCE_WARNING]
    if json_out:
        report["exit_code"] = code
        sys.stdout.write(json.dumps(report, default=json_default) + "\n")
        return code
    print_plan(spec, plan, report)
    print_refusals(plan, report, code, strict, force, str(job))
    return code


def check_recorded_run_uri(store, spec, new_run_uri: bool) -> None:
    """A job name already recorded with another run URI (the spec moved, or a relative URI once
    followed the working directory) would train twice into two places: refused naming both,
    unless ``--new-run-uri`` (and never while the recorded run is still going)."""
    from orchestrator.contract.errors import UsageError
    from orchestrator.run.state import TERMINAL_STATES

    row = store.get_job(spec.name)
    if row is None or row["run_uri"] == spec.run_uri:
        return
    if row["state"] not in TERMINAL_STATES:
        raise UsageError(f"{spec.name} is recorded ({row['state']}) with run URI {row['run_uri']}, but the job file "
                         f"now says {spec.run_uri}; stop it first (`dtrun down {spec.name}`) or give "
                         "checkpoint.uri the recorded URI; nothing rented")
    if not new_run_uri:
        raise UsageError(f"{spec.name} is recorded with run URI {row['run_uri']}, but the job file now says "
                         f"{spec.run_uri}: a new run would start from scratch there. Pass --new-run-uri to do "
                         "that, or set checkpoint.uri back to the recorded URI; nothing rented")


def cmd_up(job: Path, yes: bool = False, detach: bool = False, json_out: bool = False, strict: bool = False,
           force: bool = False, new_run_uri: bool = False) -> int:
    from orchestrator.cli.detached import spawn
    from orchestrator.cli.jobs import _ask, _err, _tty_in, job_status
    from orchestrator.contract import runuri
    from orchestrator.contract.errors import EXIT_INTERRUPTED
    from orchestrator.plan.spec import load_spec
    from orchestrator.run import prepare, uricheck
    from orchestrator.run.datacheck import check_data_vocab
    from orchestrator.run.nodecreds import node_storage
    from orchestrator.run.startup import ControllerBusy, check_start, require_usable_provider
    from orchestrator.run.state import StateStore, dtrun_home

    written = load_spec(job)
    uricheck.check_offline(written, str(job))  # exit 6 before any network or spend
    check_data_vocab(written, str(job))
    refresh_prices(list(written.resources.providers), stale_only=True)
    # The one plan, on what the nodes run (auto resolved: degrees, micro-batch, checkpointing,
    # interval); the report judges the spec as written (what auto was allowed to change).
    p = prepare.prepare(written, spec_path=str(Path(job).resolve()))
    spec, plan = p.spec, p.plan
    report = plan_report(written, plan)
    code = verdict_exit_code(written, plan, report, strict, force)  # over budget (3) before credentials (5)
    if code == EXIT_PROVIDER:
        # Every offer on a provider whose credentials are missing: exit 5 before any spend, naming
        # the file to write (SkyPilot reads ~/.runpod/config.toml, not RUNPOD_API_KEY).
        require_usable_provider(plan)
    out = sys.stderr if json_out else sys.stdout
    if not json_out:
        print_plan(written, plan, report)
    if code == EXIT_OK and report.get("does_not_fit"):
        _err(f"warning: {FORCE_WARNING}")
    if code != EXIT_OK:
        _err(refusal(plan, report, code, force))
        return code
    check_run_uri_reachable(written, plan, str(job))
    _check_credentials(plan.chosen.provider)
    node_storage(spec, plan.chosen.provider)  # a remote node needs the object store's keys: exit 5
    # S3 credentials, a write/read/list/delete probe of the run URI, remote data shards: exit 6.
    uricheck.check_online(spec, str(job))

    store = StateStore()
    check_recorded_run_uri(store, spec, new_run_uri)
    # The controller's own start-up checks (another live controller, DONE already there; a job
    # still active is continued), before anything is confirmed or rented.
    try:
        start = check_start(spec, plan, store)
    except ControllerBusy:
        pid = (store.get_job(spec.name) or {}).get("controller_pid")
        _err(f"{spec.name} is already running under controller pid {pid}; see `dtrun status {spec.name}`, "
             f"`dtrun logs {spec.name} -f`, or stop it with `dtrun down {spec.name}`")
        return EXIT_INVALID
    existing, continuing = start.job, start.reattach
    if start.uri_error is not None:
        e = start.uri_error
        raise uricheck.UriRefused(f"the run URI {spec.run_uri} cannot be used: {type(e).__name__}: {e}; nothing rented")
    if start.done:
        print(f"{spec.name} already finished: {spec.run_uri} has DONE (remove it to train again); nothing rented",
              file=out)
        if json_out:
            st = job_status(store, existing) if existing else {"name": spec.name, "state": "SUCCEEDED"}
            sys.stdout.write(json.dumps(st) + "\n")
        return EXIT_OK
    if continuing:
        live = store.nodes(spec.name, live_only=True)
        print(f"continuing {spec.name} ({existing['state']}, step {existing['step'] or 0}): "
              f"re-attaching to {len(live)} live node(s); new attempts resume from the newest checkpoint", file=out)
    elif lc := runuri.latest_committed(spec.run_uri):
        print(f"{spec.run_uri} has a checkpoint at step {lc[0]}: the trainer resumes from it", file=out)

    if not yes:
        if not _tty_in():
            _err("refusing to rent without confirmation: there is no terminal to ask on; "
                 "pass --yes to start without asking")
            return EXIT_INVALID
        if _ask(f"Start {spec.name} on {plan.chosen.key()}? [y/N] ") not in ("y", "yes"):
            print("not started; nothing rented")
            return EXIT_INTERRUPTED

    if not continuing:
        # Before the expensive part: can the run URI hold a checkpoint that restores? (On by
        # default for spot; `checkpoint.preflight` decides.) Raises PreflightError → one line.
        from orchestrator.run.preflight import maybe_preflight

        pf = maybe_preflight(spec)
        if pf is not None:
            print(f"restore preflight passed against {spec.run_uri} ({pf.seconds:.1f} s)", file=out)

    confirmed = prepare.save(p)  # what the controller launches (a later detach re-attaches with it)
    if not detach:
        return run_foreground(spec, plan, store, p.spec_path, json_out)
    pid = spawn(store, spec.name, ["--plan", str(confirmed)])
    print(f"{spec.name}: controller running in the background (pid {pid}); "
          f"log {dtrun_home() / 'logs' / spec.name / 'controller.log'}\n"
          f"  dtrun status {spec.name}   dtrun logs {spec.name} -f   dtrun down {spec.name}", file=out)
    if json_out:
        row = store.get_job(spec.name)
        sys.stdout.write(json.dumps(job_status(store, row) if row else {"name": spec.name}) + "\n")
    return EXIT_OK


def _check_credentials(provider: str) -> None:
    """The chosen offer's provider has credentials (its standard place), else exit 5 before the
    controller starts: nothing rented, no provider SDK started."""
    from orchestrator.contract.errors import ProviderRefused
    from providers import errors as perr
    from providers import registry

    try:
        registry.get(provider).check_credentials()
    except perr.AuthError as e:
        raise ProviderRefused(f"{e}; nothing rented") from None


# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def schema() -> None:
    """Print the job spec's JSON schema (for editor completion)."""
    import json

    from orchestrator.plan.spec import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))



@app.command()
def up(
    job: JobArg,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Estimate and plan only; rent nothing.")] = False,
    json_out: JsonOpt = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Run the controller in the background.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Known traps are errors (exit 2), not warnings.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Rent even when the plan does not fit the GPU's memory (exit 4 otherwise); warns.")] = False,
    new_run_uri: Annotated[bool, typer.Option(
        "--new-run-uri", help="The job is recorded with another run URI: start over at the spec's one.")] = False,
) -> None:
    """Estimate, confirm, then run the job to the end (or only estimate, with --dry-run)."""
    from orchestrator.cli import remote

    if remote.target():  # a dtrun server plans, checks the team's budget and runs the job
        raise typer.Exit(remote.up(job, dry_run=dry_run, yes=yes, json_out=json_out, strict=strict, force=force))
    if dry_run:
        raise typer.Exit(cmd_dry_run(job, json_out, strict, force))
    raise typer.Exit(cmd_up(job, yes=yes, detach=detach, json_out=json_out, strict=strict, force=force,
                            new_run_uri=new_run_uri))
