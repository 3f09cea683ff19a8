"""``dtrun report JOB [--out FILE]``: parse, call ``orchestrator.run.report``, print the path.
Works while the job runs (a snapshot) and after it ended. Exit 6: no such job."""

from __future__ import annotations

from pathlib import Path

from orchestrator.contract.errors import EXIT_OK


def cmd_report(job: str, out: Path | None) -> int:
    from orchestrator.run.report import render
    from orchestrator.run.state import StateStore

    path = render(StateStore(), job, out)
    print(f"{path}  (loss.png, throughput.png, spend.png beside it)")
    return EXIT_OK
