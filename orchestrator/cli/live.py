"""What ``dtrun up`` shows while the controller runs.

On a terminal: a rich live view — state, a progress bar of steps with ETA, loss, tokens/s, spend
against the budget, attempts, and the newest events. Without one (CI, nohup, a pipe, the detached
controller's log): plain timestamped lines — every event, and a progress line every
``every_s`` seconds while the step moves.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from orchestrator.run.state import StateStore


def _money(x: float | None) -> str:
    if x is None:
        return "—"
    return f"${x:,.4f}" if x < 1 else f"${x:,.2f}"


def snapshot(store: StateStore, name: str, budget: float | None = None) -> dict[str, Any]:
    """The job's numbers for one frame. ``budget``: the spec's ``budget.max_usd``, for the frames
    before the controller has recorded the job (its row has the budget from then on)."""
    job = store.get_job(name) or {}
    atts = store.attempts(name)
    first = job.get("session_first_attempt") or 1
    return {
        "state": job.get("state"), "reason": job.get("reason"), "step": job.get("step"),
        "steps": job.get("steps"), "loss": job.get("loss"), "tokens_per_s": job.get("tokens_per_s"),
        "val_loss": job.get("val_loss"), "recorded": bool(job),
        "cost": store.spend_total(name), "budget": job["budget_usd"] if job else budget,
        "attempts": len([a for a in atts if a["n"] >= first]), "attempt": atts[-1]["n"] if atts else None,
        "committed": job.get("last_committed_step"), "steps_lost": job.get("steps_lost") or 0,
        "build": _building(store, name, job, atts),
    }


def _building(store: StateStore, name: str, job: dict[str, Any], atts: list[dict]) -> dict[str, Any] | None:
    """The image layer the current attempt's launch is building (its newest ``build`` event), while
    the job is PROVISIONING; None otherwise."""
    if job.get("state") != "PROVISIONING" or not atts:
        return None
    for e in reversed(store.events(name, limit=20)):
        d = e.get("data") or {}
        if e["type"] == "build" and d.get("attempt") == atts[-1]["n"]:
            return d
    return None


def build_line(b: dict[str, Any], now: float | None = None) -> str:
    """``building image: layer 2 of 5 (torch), 37 s elapsed`` (elapsed in this layer)."""
    now = time.time() if now is None else now
    since = b.get("since")
    took = f", {max(0.0, now - since):.0f} s elapsed" if since else ""
    return f"building image: layer {b.get('layer')} of {b.get('layers')} ({b.get('label')}){took}"


def progress_line(s: dict[str, Any]) -> str:
    step = s["step"] if s["step"] is not None else 0
    steps = s["steps"] or "?"  # a command job without command.steps: the total is unknown until it prints one
    parts = [f"{s['state']}", f"step {step}/{steps}"]
    if s.get("build"):
        parts = [f"{s['state']}", build_line(s["build"])]
    if s["loss"] is not None:
        parts.append(f"loss {s['loss']:.4f}")
    if s.get("val_loss") is not None:
        parts.append(f"val {s['val_loss']:.4f}")
    if s["tokens_per_s"]:
        parts.append(f"{s['tokens_per_s']:,.0f} tok/s")
    parts.append(f"spend {_money(s['cost'])}" + (f" of {_money(s['budget'])}" if s["budget"] is not None else ""))
    parts.append(f"attempt {s['attempt'] or '-'} ({s['attempts']} this run)")
    return " | ".join(parts)


def spend_cap(s: dict[str, Any]) -> str:
    """`` / $1.00``; `` (no budget cap)`` only for a job recorded without ``budget.max_usd``; nothing
    while the budget is not known yet (the first frames, before the controller records the job)."""
    if s["budget"] is not None:
        return f" / {_money(s['budget'])}"
    return " (no budget cap)" if s.get("recorded") else ""


class PlainView:
    """Plain lines for logs and pipes."""

    def __init__(self, store: StateStore, name: str, out: TextIO | None = None, every_s: float = 10.0) -> None:
        self.store, self.name = store, name
        self.out = out or sys.stdout
        self.every_s = every_s
        self._last_line = 0.0
        self._last_step: Any = None

    def __enter__(self) -> "PlainView":
        return self

    def __exit__(self, *a: Any) -> None:
        pass

    def line(self, text: str) -> None:
        self.out.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        self.out.flush()

    def event(self, type_: str, message: str) -> None:
        self.line(f"[{type_}] {message}")

    def update(self, ctl: Any = None) -> None:
        now = time.monotonic()
        s = snapshot(self.store, self.name)
        if (s["step"] != self._last_step or s.get("build")) and now - self._last_line >= self.every_s:
            self._last_line, self._last_step = now, s["step"]
            self.line(progress_line(s))


class RichView:
    """The live terminal view."""

    def __init__(self, store: StateStore, name: str, console: Any = None, budget: float | None = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.store, self.name, self.budget = store, name, budget
        self.console = console or Console()
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("steps · ETA"), TimeRemainingColumn(), console=self.console)
        self.task = self.progress.add_task(name, total=None)
        self.events: list[str] = []
        self.live: Any = None

    def _render(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        s = snapshot(self.store, self.name, self.budget)
        if s["steps"]:
            self.progress.update(self.task, total=s["steps"], completed=s["step"] or 0)
        head = Text.assemble((f"{self.name} ", "bold"), (s["state"] or "", "cyan"),
                             (f"  {s['reason']}" if s["reason"] else "", "dim"))
        metrics = Text(f"loss {s['loss']:.4f}" if s["loss"] is not None else "loss —")
        if s.get("val_loss") is not None:
            metrics.append(f"   val loss {s['val_loss']:.4f}")
        metrics.append(f"   {s['tokens_per_s']:,.0f} tok/s" if s["tokens_per_s"] else "   — tok/s")
        spend = f"   spend {_money(s['cost'])}" + spend_cap(s)
        metrics.append(spend, style="yellow" if s["budget"] is not None and s["cost"] > 0.8 * s["budget"] else None)
        metrics.append(f"   attempts {s['attempts']}   last committed step {s['committed'] if s['committed'] is not None else '—'}")
        if s["steps_lost"]:
            metrics.append(f"   steps lost {s['steps_lost']}")
        ev = Text("\n".join(self.events[-5:] + [f"report: dtrun report {self.name}"]), style="dim")
        if s.get("build"):
            return Group(head, Text(build_line(s["build"]), style="cyan"), self.progress, metrics, ev)
        return Group(head, self.progress, metrics, ev)

    def __enter__(self) -> "RichView":
        from rich.live import Live

        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self.live.__enter__()
        return self

    def __exit__(self, *a: Any) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.__exit__(*a)
            self.live = None

    def line(self, text: str) -> None:
        self.console.print(text)

    def event(self, type_: str, message: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} [{type_}] {message.splitlines()[0] if message else ''}")
        if self.live is not None:
            self.live.update(self._render())

    def update(self, ctl: Any = None) -> None:
        if self.live is not None:
            self.live.update(self._render())


def make_view(store: StateStore, name: str, tty: bool | None = None) -> PlainView | RichView:
    if tty is None:
        tty = sys.stdout.isatty()
    return RichView(store, name) if tty else PlainView(store, name)
