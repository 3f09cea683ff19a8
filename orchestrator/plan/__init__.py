"""What a job is and what it will cost, before anything is rented.

``spec`` (the job file, pydantic, ``extra="forbid"``), ``presets`` (model shapes), ``estimate``
(offers × hours × (1 + buffer)), ``planner`` (memory per GPU, parallel layout), ``traps`` (known
ways to waste money). Pure Python: imports ``orchestrator.contract`` and ``providers`` (offers,
never an SDK); never torch, never ``run/`` or ``cli/``.
"""
