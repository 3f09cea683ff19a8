"""The orchestrator: everything that runs on the user's machine, by concern.

Data flows ``cli`` → ``plan`` → ``run`` → ``providers`` (and back through the run URI):

- ``contract/`` — at the bottom, imported by all, importing nothing of dtrun: the run-URI
  contract (paths, markers, exit codes), the error hierarchy with its exit codes, GPU facts.
- ``plan/`` — spec, model presets, estimate, memory planner, traps. Pure Python: no torch, no
  provider SDK, nothing from ``run/`` or ``cli/``.
- ``run/`` — controller, recovery, billing guard, state store, clock, orphan sweep, node
  credentials, preflight, the simulator. May import ``plan``, ``contract`` and ``providers``.
- ``cli/`` — the typer app, one module per command noun; parses, calls, prints. Nothing
  imports ``cli``.

``tests/test_layout.py`` fails when an import crosses one of these lines.
"""
