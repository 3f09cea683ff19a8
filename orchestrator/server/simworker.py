"""The child process of the server's ``POST /v1/simulate`` (``orchestrator.server.api_extra``):
the request body (already validated there) on stdin; on stdout ``{"name", "report"}`` — the
embedded ``simulate_job`` report — or ``{"error", "exit_code"}`` (exit 2) for a refusal of the
simulation itself (``--runs``, ``--preemptions-per-hour``, … out of range). Imports no web
framework: it starts in about a second."""

from __future__ import annotations

import json
import sys


def main() -> int:
    from orchestrator.contract.errors import DtrunError
    from orchestrator.plan.spec import parse_spec
    from orchestrator.run.simulate import simulate_job

    body = json.loads(sys.stdin.read())
    try:
        spec, out = simulate_job(parse_spec(body["spec"], source="spec"), body.get("preemptions_per_hour"),
                                 int(body["runs"]), int(body["seed"]), no_capacity=body.get("no_capacity") or 0.0,
                                 notice_seconds=body.get("notice_seconds"), soft_fraction=body.get("soft_fraction"))
    except DtrunError as e:
        sys.stdout.write(json.dumps({"error": " ".join(str(e).split()), "exit_code": e.exit_code}))
        return 2
    sys.stdout.write(json.dumps({"name": spec.name, "report": out}, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
