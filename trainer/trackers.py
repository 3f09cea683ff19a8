"""Optional experiment trackers (``trainer.trackers``), rank 0 only, off by default.

* ``tensorboard``: event files written with tensorboardX (a small, pure-Python writer; TensorFlow
  is not needed) into a local temporary folder and copied to ``<run-uri>/tensorboard/`` after each
  write, so ``tensorboard --logdir <run-uri>/tensorboard`` (or a synced copy) shows the run while it
  trains. Each attempt writes its own event file.
* ``wandb``: ``wandb.init(project=$WANDB_PROJECT or "dtrun", name=<job>, resume="allow",
  id=<job + run-URI hash>)`` so every attempt logs into one W&B run. The API key comes from the
  environment (``WANDB_API_KEY``) or wandb's own login; dtrun never reads, logs or stores it.

A tracker that cannot start is one ``ConfigError`` naming what is missing (before step 1).
A tracker that fails while training logs a warning and is dropped: training never waits on it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import Any

from orchestrator.contract import runuri
from trainer.errors import ConfigError

log = logging.getLogger("trainer")


class _TensorBoard:
    def __init__(self, run_uri: str, attempt: int):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("trainer.trackers: tensorboard needs the tensorboardX package "
                              "(pip install 'dtrun[trackers]')") from None
        self.run_uri = run_uri
        self.dir = tempfile.mkdtemp(prefix="dtrun-tb-")
        self.w = SummaryWriter(logdir=self.dir, filename_suffix=f".attempt{attempt}", flush_secs=3600)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            if v is not None:
                self.w.add_scalar(k, v, step)
        self.w.flush()
        for name in os.listdir(self.dir):
            with open(os.path.join(self.dir, name), "rb") as f:
                data = f.read()
            target = runuri.join(self.run_uri, "tensorboard", name)
            lp = runuri.local_path(target)
            if lp is not None:
                os.makedirs(os.path.dirname(lp), exist_ok=True)
                with open(lp + ".tmp", "wb") as f:
                    f.write(data)
                os.replace(lp + ".tmp", lp)
            else:
                fs, path = runuri._fs(target)
                fs.pipe_file(path, data)

    def close(self) -> None:
        self.w.close()


class _WandB:
    def __init__(self, run_uri: str, name: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError("trainer.trackers: wandb needs the wandb package (pip install wandb)") from None
        rid = f"{name}-{hashlib.sha256(run_uri.encode()).hexdigest()[:8]}"
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dtrun"), name=name, id=rid,
                              resume="allow", config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({k: v for k, v in values.items() if v is not None}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    def __init__(self, names: list[str], *, run_uri: str, job: str, attempt: int, config: dict[str, Any]):
        self.items: list[Any] = []
        for n in names:
            if n == "tensorboard":
                self.items.append(_TensorBoard(run_uri, attempt))
            elif n == "wandb":
                self.items.append(_WandB(run_uri, job, config))

    def log(self, step: int, values: dict[str, float]) -> None:
        for t in list(self.items):
            try:
                t.log(step, values)
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                log.warning("tracker %s failed (%s: %s); dropped", type(t).__name__, type(e).__name__, e)
                self.items.remove(t)

    def close(self) -> None:
        for t in self.items:
            try:
                t.close()
            except Exception:  # noqa: BLE001
                pass
