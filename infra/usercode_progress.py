"""A ``command:`` job's progress, read from its output: each line (split on \\n and \\r, so
progress bars count) is matched against ``command.step_pattern`` (the step, and the total when the
pattern has a second group) and ``command.loss_pattern`` (the loss). ``infra/usercode.py`` turns
it into ``progress.json`` heartbeats and ``metrics.jsonl`` rows. Standard library only.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Progress:
    step_re: re.Pattern
    loss_re: re.Pattern | None
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    lines: int = 0
    changed_at: float = 0.0
    rows: list = field(default_factory=list)  # (step, loss, time) of each new step with a loss
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_rows(self, most: int = 4) -> list:
        """The steps seen since the last call, thinned evenly to ``most`` (the newest kept)."""
        with self.lock:
            rows, self.rows = self.rows, []
        if len(rows) > most:
            k = len(rows) / most
            rows = [rows[len(rows) - 1 - int(i * k)] for i in range(most)][::-1]
        return rows

    def feed(self, line: str) -> None:
        self.lines += 1
        m = self.step_re.search(line)
        if not m:
            return
        try:
            step = int(m.group(1))
        except (TypeError, ValueError):
            return
        total = None
        if self.step_re.groups >= 2 and m.group(2):
            try:
                total = int(m.group(2))
            except ValueError:
                total = None
        loss = None
        if self.loss_re is not None:
            lm = self.loss_re.search(line)
            if lm:
                try:
                    loss = float(lm.group(1))
                except ValueError:
                    loss = None
        with self.lock:
            if self.step is None or step >= self.step:  # ranks print the same step; keep the newest
                if step != self.step:
                    self.changed_at = time.time()
                    if loss is not None:
                        self.rows.append((step, loss, self.changed_at))
                self.step = step
                if total:
                    self.steps = total
                if loss is not None:
                    self.loss = loss


class Tee:
    """A binary sink that copies the command's output to ``dst`` and feeds each line (split on
    \n and \r: progress bars) to ``progress``."""

    def __init__(self, dst, progress: Progress) -> None:
        self.dst, self.progress, self.buf = dst, progress, b""

    def write(self, chunk: bytes) -> None:
        try:
            self.dst.write(chunk)
        except (OSError, ValueError):
            pass
        self.buf += chunk
        parts = re.split(rb"[\r\n]", self.buf)
        self.buf = parts.pop()
        for p in parts:
            if p:
                self.progress.feed(p.decode(errors="replace"))
        if len(self.buf) > 1 << 20:
            self.buf = self.buf[-4096:]

    def flush(self) -> None:
        try:
            self.dst.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self.buf:
            self.progress.feed(self.buf.decode(errors="replace"))
            self.buf = b""
