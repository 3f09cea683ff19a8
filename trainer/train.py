"""The training run: ``torchrun --nproc-per-node N -m trainer --job JOB.yaml --run-uri URI``.

Order of events (every failure before step 1 is a one-line error and exit 2):

1. load and validate the job spec; ``ParallelDims`` against ``WORLD_SIZE`` — before any process
   group; batch sizes against the data-parallel degree;
2. rank 0 probes the run URI (write, read back, delete) — unreachable/unwritable → exit 2; then
   starts the heartbeat thread (trainer.metrics): progress.json every ``trainer.heartbeat_seconds``
   from here on, whatever the main thread does, with ``phase`` starting → loading_checkpoint →
   first_step → training (⇄ checkpointing, evaluating) → stopping;
3. process groups (gloo on CPU, nccl + gloo on GPU), meshes; the model is built on the meta
   device, parallelised (TP → EP → AC → compile → FSDP2), materialised and initialised from the
   seed; optimizer; data loader;
4. resume from the newest COMMITTED checkpoint, if any;
5. the loop. After each optimizer step one all-reduce carries (SIGTERM seen, STOP seen by rank 0,
   auto-checkpoint due, loss): every rank agrees on what happens next.
   * SIGTERM (spot notice; torchrun forwards it) → emergency checkpoint (sync, after the in-flight
     async one) → exit 75 (``runuri.EXIT_PREEMPTED``: "resume me").
   * ``STOP`` in the run URI (polled by a rank-0 thread every 0.5 s) → checkpoint → exit 0.
   * the last step → final checkpoint committed → ``DONE`` (final metrics, incl. ``param_digest``,
     a sha256 of every parameter: equal digests = bit-identical models; on CPU, or on GPU only
     when ``DTRUN_PARAM_DIGEST=1`` — a full-model gather to rank 0 is minutes of idle GPUs at 70B,
     and GPU runs are not bitwise reproducible anyway) → exit 0.

Steps 1–3 (the checks, the probe, the heartbeat, the parts the loop trains with) are
:mod:`trainer.build`; this module is the run's order of events and the loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from orchestrator.contract import runuri
from orchestrator.contract.runuri import EXIT_BAD_CONFIG, EXIT_DONE, EXIT_PREEMPTED
from trainer.build import build_parts, check_job, probe_run_uri, start_heartbeat
from trainer.build import check_data_vocab  # noqa: F401 - trainer.train.check_data_vocab, as datacheck.py names it
from trainer.errors import CheckpointUnavailable, ConfigError, SavesFailing

log = logging.getLogger("trainer")

AUTO_CHECKPOINT_SECONDS = 600.0
"""``checkpoint.every_steps: auto`` when the orchestrator did not resolve it: every 10 minutes."""

STEP_SLEEP_ENV = "DTRUN_DEBUG_STEP_SLEEP"
"""Debug/test knob: seconds to sleep after each step (lets tests kill a run between checkpoints)."""

LOAD_SLEEP_ENV = "DTRUN_DEBUG_LOAD_SLEEP"
"""Test-only knob: seconds to sleep in the ``loading_checkpoint`` phase (before the resume), to
stand for a slow checkpoint load in heartbeat tests. Never set it in a real run."""


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer", allow_abbrev=False,
                                description="The dtrun trainer (run it under torchrun).")
    p.add_argument("--job", required=True, help="job spec YAML (orchestrator.plan.spec)")
    p.add_argument("--run-uri", dest="run_uri", default=None, help="override the spec's run URI")
    return p.parse_args(argv)


def _normalize_uri(uri: str) -> str:
    if "://" not in uri:
        return "file://" + os.path.abspath(os.path.expanduser(uri))
    if uri.startswith("file://"):
        return "file://" + os.path.abspath(os.path.expanduser(uri[len("file://"):]))
    return uri


class _Flags:
    def __init__(self) -> None:
        self.sigterm = False
        self.sigterm_at: float | None = None  # time.monotonic() of the first SIGTERM
        self.stop = False

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.sigterm = True
        if self.sigterm_at is None:
            self.sigterm_at = time.monotonic()


def _stop_poller(uri: str, flags: _Flags, done: threading.Event) -> None:
    stop_uri = runuri.join(uri, runuri.STOP)
    while not done.is_set():
        try:
            if runuri.exists(stop_uri):
                flags.stop = True
                return
        except Exception:  # noqa: BLE001 - a failed poll is retried on the next tick
            pass
        done.wait(0.5)


PARAM_DIGEST_ENV = "DTRUN_PARAM_DIGEST"
"""``1``: write ``param_digest`` into DONE also on GPU; ``0``: not even on CPU. Unset: CPU only."""


def want_digest(device_type: str, env: dict[str, str] | None = None) -> bool:
    raw = (os.environ if env is None else env).get(PARAM_DIGEST_ENV, "").strip()
    if raw in ("0", "1"):
        return raw == "1"
    return device_type == "cpu"


def _peer_lost_line(e: BaseException, committed: int | None = None) -> str:
    first = (str(e).splitlines() or [""])[0][:300]
    return (f"a collective failed: a peer rank is gone, or hung past trainer.collective_timeout_seconds "
            f"({type(e).__name__}: {first}); the attempt resumes from the last COMMITTED checkpoint"
            + (f" (step {committed})" if committed is not None else ""))


# A collective fails on every survivor the moment a peer's process closes its sockets, whatever
# the peer died of. Waiting this long before exiting 75 lets a peer that failed for a reason of its
# own (a bad-config exit 2: bad data in its batch) reach torchrun first, so the node's exit code
# (infra/torchrun_launch.py: 2 beats 75) names the cause instead of asking for an endless resume.
PEER_LOST_GRACE_SECONDS = 3.0


def _hard_exit(why: str) -> None:
    """Exit 75 ("resume me") after :data:`PEER_LOST_GRACE_SECONDS`: no interpreter shutdown, no
    process-group teardown (either can block on a peer that is gone)."""
    time.sleep(PEER_LOST_GRACE_SECONDS)
    print(f"dtrun trainer: rank {os.environ.get('RANK', '0')}: {why}; exit {EXIT_PREEMPTED}",
          file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(EXIT_PREEMPTED)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank{}] %(levelname)s %(message)s".format(
        os.environ.get("RANK", "0")), stream=sys.stdout)
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        run = Run(args)
        code = run.run()
        if run.abandoned_upload:
            # A checkpoint upload abandoned at a preemption notice still runs in DCP's worker
            # thread; interpreter shutdown would join it. The emergency state is committed: go.
            log.warning("exiting %d without waiting for the abandoned upload", code)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except ConfigError as e:
        # Every rank raises the same ConfigError (rank 0 prints it), except a rank-local one (bad
        # data in this rank's batch): the others then fail in a collective, so this rank says why.
        if int(os.environ.get("RANK", "0")) == 0 or getattr(e, "rank_local", False):
            print(f"dtrun trainer: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    except CheckpointUnavailable as e:  # storage trouble at resume, or saves failing: retryable
        if int(os.environ.get("RANK", "0")) == 0 or isinstance(e, SavesFailing):
            print(f"dtrun trainer: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # before the loop (building, resuming): a peer gone → resume, not fail
        from trainer.distenv import peer_lost

        if not peer_lost(e):
            raise
        _hard_exit(_peer_lost_line(e))
        raise  # not reached: _hard_exit does not return


class Run:
    def __init__(self, args: argparse.Namespace):
        from orchestrator.contract.errors import SpecError
        from orchestrator.plan.spec import load_spec

        try:
            self.spec = load_spec(args.job)
        except SpecError as e:
            raise ConfigError(str(e)) from None
        self.run_uri = _normalize_uri(args.run_uri or self.spec.run_uri)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.abandoned_upload = False

    def run(self) -> int:
        # From here on a SIGTERM is remembered and honoured after the next step (with a checkpoint).
        self.flags = _Flags()
        signal.signal(signal.SIGTERM, self.flags.on_sigterm)

        self.dims, self.mb = check_job(self.spec, self.world, self.rank)
        return self._run_distributed()

    def _run_distributed(self) -> int:
        import torch.distributed as dist

        from trainer.distenv import init_distributed, select_device

        self.device = select_device(self.spec, self.local_rank)  # GPU asked, CUDA unusable: exit 2
        if self.world > 1 or ("MASTER_ADDR" in os.environ and "RANK" in os.environ):
            t_join = time.monotonic()
            init_distributed(self.spec, self.device)  # trainer.collective_timeout_seconds
            if self.rank == 0:  # how long the ranks (of every node) took to find each other
                nodes = self.world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or self.world))
                print(f"dtrun trainer: {self.world} ranks on {nodes} node(s) joined the process group in "
                      f"{time.monotonic() - t_join:.1f} s", flush=True)
        try:
            # The run URI must be usable before step 1 (rank 0 probes, everyone learns the verdict).
            err = None
            if self.rank == 0:
                try:
                    probe_run_uri(self.run_uri)
                except ConfigError as e:
                    err = str(e)
            if dist.is_initialized():
                box = [err]
                dist.broadcast_object_list(box, src=0)
                err = box[0]
            if err:
                raise ConfigError(err)
            self.metrics = start_heartbeat(self.spec, self.run_uri, self.rank, self.world, self.device)
            try:
                return self._train()
            finally:
                self.metrics.close()
        finally:
            if dist.is_initialized() and not self.abandoned_upload:  # an abandoned upload may still use it
                dist.destroy_process_group()

    def _train(self) -> int:
        import torch
        import torch.distributed as dist

        from trainer.checkpoint import HARD_EXIT_MARGIN_S, NOTICE_S, emergency_plan, param_digest
        from trainer.distenv import peer_lost
        from trainer.model import add_aux, local_value, loss_context, loss_fn
        from trainer.optim import lr_at
        from trainer.parallel import (amp_context, clip_grad_norm_, finish_expert_grads, held_grad_bytes,
                                      sharded_state_bytes)

        spec, t, dims, device = self.spec, self.spec.trainer, self.dims, self.device
        parts = build_parts(spec, dims, self.mb, device, self.rank, self.world, self.run_uri)
        model, params, optimizer, loader, evaluator, ckpt = (parts.model, parts.params, parts.optimizer,
                                                             parts.loader, parts.evaluator, parts.ckpt)
        scaler, meshes, on_gpu, param_dtype = parts.scaler, parts.meshes, parts.on_gpu, parts.param_dtype
        pipe = parts.pipe
        pp_group = pipe.group if pipe is not None else None
        stage_group = pipe.stage_group if pipe is not None else None
        total = t.total_steps
        metrics = self.metrics

        step, tokens, last_loss = 0, 0, float("nan")
        metrics.set_phase("loading_checkpoint")
        load_sleep = float(os.environ.get(LOAD_SLEEP_ENV, "0") or 0)
        if load_sleep:
            time.sleep(load_sleep)
        resumed = ckpt.load_latest(model, optimizer, loader)
        if resumed is not None:
            step, tokens, last_loss = int(resumed["step"]), int(resumed["tokens"]), float(resumed["loss"])
            if self.rank == 0:
                log.info("resumed from checkpoint step %d", step)
        every = spec.checkpoint.every_steps
        flags = self.flags
        poll_done = threading.Event()
        if self.rank == 0:
            threading.Thread(target=_stop_poller, args=(self.run_uri, flags, poll_done), daemon=True).start()
        metrics.start(step)
        metrics.progress(step, None if step == 0 else last_loss, ckpt.last_committed, force=True, phase="first_step")
        last_auto = time.monotonic()
        step_sleep = float(os.environ.get(STEP_SLEEP_ENV, "0") or 0)
        state_bytes: dict[str, int] | None = None
        moe_layers = model.moe_layers()
        cp = getattr(model, "cp", None)  # context parallelism: this rank's slice of every sequence
        if cp is not None and self.rank == 0:
            log.info("context parallel: cp %d, each rank holds %d of %d tokens of every sequence (rank 0: "
                     "chunks %s of %d)", cp.size, t.seq_len // cp.size, t.seq_len, cp.chunks(), 2 * cp.size)
        t_start = time.time()

        def save(at: int, sync: bool = False, emergency: bool = False) -> None:
            in_loop = metrics.phase == "training"  # else: stopping (the final/emergency save)
            if in_loop:
                metrics.set_phase("checkpointing")
            sd = ckpt.state_dict(model, optimizer, loader, {"step": at, "tokens": tokens, "loss": last_loss})
            ckpt.save(at, sd, {"tokens": tokens, "loss": last_loss}, sync=sync, emergency=emergency)
            if in_loop:
                metrics.set_phase("training")

        def evaluate() -> None:
            metrics.set_phase("evaluating")  # not a stalled step: the heartbeat keeps beating
            metrics.eval(step, evaluator.evaluate(model, device, lambda: amp_context(device, param_dtype, meshes)))

        def finish(code: int, status: str) -> int:
            poll_done.set()
            metrics.progress(step, last_loss, ckpt.last_committed, status=status, force=True, exit_code=code,
                             phase="stopping")
            return code

        try:
            while step < total:
                lr = lr_at(step, lr=t.lr, warmup_steps=t.warmup_steps, total_steps=total,
                           min_lr_ratio=t.min_lr_ratio)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                loss_acc = torch.zeros((), device=device)
                accum = loader.accum_steps
                last = step == total - 1
                grads_peak = 0
                # Every micro-batch's backward reduce-scatters its gradients (FSDP2's default, as
                # torchtitan): a rank holds sharded gradients between micro-batches, never the
                # full-size accumulation that set_requires_gradient_sync(False) would keep.
                if pipe is not None:  # the schedule runs every micro-batch's forward and backward
                    with amp_context(device, param_dtype, meshes):
                        loss_acc = pipe.step(loader.batches(step), scaler, t.z_loss, model)
                for x, y in (loader.batches(step) if pipe is None else ()):
                    if cp is not None:  # the tokens and their labels, sliced alike (head-tail)
                        x, y = cp.shard(x), cp.shard(y)
                    with loss_context(model):  # loss_parallel under TP with an untied head
                        with amp_context(device, param_dtype, meshes):
                            loss, ce = loss_fn(model(x), y, t.z_loss)
                            loss = add_aux(loss, model.aux_loss())
                        scaler.scale_loss(loss / accum).backward()
                    loss_acc += local_value(ce.detach()) / accum
                    if last:
                        grads_peak = max(grads_peak, held_grad_bytes(model))
                finish_expert_grads(model, dims, meshes)
                scaler.unscale_(params)
                gnorm = clip_grad_norm_(params, t.grad_clip, pp_group)
                if scaler.update(gnorm):
                    optimizer.step()
                elif self.rank == 0:
                    log.warning("fp16 overflow at step %d: step skipped, loss scale now %g", step, scaler.scale)
                if last:
                    state_bytes = sharded_state_bytes(model, optimizer)  # grads + optimizer state present
                    state_bytes["grads_peak"] = grads_peak  # most gradient bytes held during the step
                    if on_gpu:  # for benchmarks/gpu_check.sh: planner bytes vs the allocator's peaks
                        state_bytes["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated(device))
                        state_bytes["cuda_max_reserved"] = int(torch.cuda.max_memory_reserved(device))
                        free, total = torch.cuda.mem_get_info(device)  # the driver's view (nvidia-smi)
                        state_bytes["cuda_device_used"] = int(total - free)  # + context, NCCL buffers
                optimizer.zero_grad(set_to_none=True)
                if moe_layers and any(m.balance == "bias" for m in moe_layers):
                    counts = torch.stack([m.tokens_per_expert for m in moe_layers])
                    if dist.is_initialized():
                        dist.all_reduce(counts, group=stage_group)
                    for m, c in zip(moe_layers, counts):
                        m.update_bias(c)
                for m in moe_layers:
                    m.tokens_per_expert.zero_()
                loader.advance(step)
                step += 1
                if step_sleep:
                    time.sleep(step_sleep)
                tokens += t.tokens_per_step

                # One all-reduce and the step's one host sync: SIGTERM anywhere, STOP (rank 0),
                # auto-checkpoint due (rank 0), loss, grad norm (already global: averaged back).
                auto_due = every == "auto" and time.monotonic() - last_auto >= AUTO_CHECKPOINT_SECONDS
                host = torch.tensor([float(flags.sigterm), float(flags.stop and self.rank == 0),
                                     float(auto_due and self.rank == 0)])
                vec = torch.cat([host.to(device, non_blocking=True), loss_acc.float().view(1),
                                 gnorm.float().view(1).to(device)])
                if dist.is_initialized():
                    dist.all_reduce(vec)
                    if pipe is None:
                        vec[3:] /= self.world
                    else:  # the loss is on the last stage's ranks only (0 elsewhere)
                        vec[3] /= self.world // dims.pp
                        vec[4] /= self.world
                term, stop, auto_now, last_loss, gnorm_v = vec.tolist()
                ckpt.poll()
                metrics.step(step, last_loss, gnorm_v, lr, ckpt.last_committed)

                if term > 0:
                    # Whatever the collectives below do (a peer's VM gone mid-save), this process
                    # exits 75 within the notice plus a margin: the attempt resumes from the last
                    # COMMITTED step.
                    since = time.monotonic() - (flags.sigterm_at or time.monotonic())
                    hard = threading.Timer(max(1.0, NOTICE_S + HARD_EXIT_MARGIN_S - since), _hard_exit,
                                           args=(f"the emergency save of step {step} did not finish within the "
                                                 f"notice ({NOTICE_S:g} s + {HARD_EXIT_MARGIN_S:g} s)",))
                    hard.daemon = True
                    hard.start()
                    metrics.set_phase("stopping")
                    # Bounded by the notice: rank 0 decides how long to wait for an in-flight upload
                    # and whether a save of this step still fits (from measured save times).
                    plan = [None]
                    if self.rank == 0:
                        elapsed = time.monotonic() - (flags.sigterm_at or time.monotonic())
                        plan = [emergency_plan(elapsed, ckpt.inflight_left_s(),
                                               max(ckpt.upload_s) if ckpt.upload_s else None)]
                    if dist.is_initialized():
                        dist.broadcast_object_list(plan, src=0, group=ckpt.pg_emergency)
                    wait_s, fits = plan[0]
                    ckpt.settle(timeout=wait_s)
                    self.abandoned_upload = ckpt.abandoned is not None
                    if ckpt.last_committed != step:
                        if fits:
                            log.warning("SIGTERM: emergency checkpoint at step %d", step)
                            save(step, sync=True, emergency=True)
                        else:
                            log.warning("SIGTERM: a save of step %d does not fit the notice; resuming from "
                                        "step %s", step, ckpt.last_committed)
                    return finish(EXIT_PREEMPTED, "preempted")
                if stop > 0:
                    if self.rank == 0:
                        log.info("STOP found in the run URI: checkpoint at step %d and exit", step)
                    metrics.set_phase("stopping")
                    ckpt.settle()
                    if ckpt.last_committed != step:
                        save(step, sync=True)
                    return finish(EXIT_DONE, "stopped")
                if evaluator is not None and t.eval_every and step % t.eval_every == 0 and step < total:
                    evaluate()
                    metrics.set_phase("training")
                due = (isinstance(every, int) and step % every == 0) or auto_now > 0
                if due and step < total:
                    save(step)
                    last_auto = time.monotonic()

            if evaluator is not None:
                # The final validation loss, here also when resumed at the last step (its checkpoint
                # committed, DONE not yet written: the loop ran no step).
                evaluate()
            metrics.set_phase("stopping")
            ckpt.settle()
            if ckpt.last_committed != step:
                save(step, sync=True)
                ckpt.settle()
            digest = None
            if want_digest(device.type):
                digest = param_digest(model) if pipe is None else pipe.param_digest(model)
            all_bytes = [state_bytes]
            if dist.is_initialized():
                all_bytes = [None] * self.world
                dist.all_gather_object(all_bytes, state_bytes)
            if self.rank == 0:
                if ckpt.last_committed == step:
                    runuri.write_json(runuri.join(self.run_uri, runuri.DONE), {
                        "step": step, "loss": last_loss, "tokens": tokens, "time": time.time(),
                        "elapsed_s": time.time() - t_start, "param_digest": digest,
                        "val_loss": metrics.val_loss,
                        "world_size": self.world, "checkpoint_stall_s": ckpt.stall_s,
                        "parallel": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
                                     "pp": dims.pp,
                                     "ep": dims.ep, **({"cp": dims.cp} if dims.cp > 1 else {})},
                        # per rank, after the last optimizer step (None if this attempt ran no step)
                        "state_bytes_per_rank": all_bytes,
                    })
                    log.info("done: step %d loss %.4f", step, last_loss)
                else:
                    log.warning("final checkpoint not committed; DONE not written")
            return finish(EXIT_DONE, "done")
        except BaseException as e:
            if not isinstance(e, (KeyboardInterrupt, SystemExit)) and peer_lost(e):
                metrics.progress(step, last_loss, ckpt.last_committed, status="peer_lost", force=True,
                                 exit_code=EXIT_PREEMPTED, phase="stopping")
                metrics.close()  # the queued progress.json write lands before the hard exit
                _hard_exit(_peer_lost_line(e, ckpt.last_committed))
            raise
        finally:
            poll_done.set()
            loader.close()
            ckpt.close()
