"""What a job is and what it will cost, before anything is rented.

``spec`` (the job file: ``JobSpec``, loading with messages that name the line, the schema) over
``sections`` (its pydantic sections, ``extra="forbid"``), ``presets`` (model shapes), ``hours``
(step time, start-up, checkpoint cost and interval), ``estimate`` (offers × hours × (1 + buffer),
the ranked plan), ``planner`` (will it fit: auto plan, fit check, ``resolve_parallel``) over
``memory`` (bytes per GPU rank), ``ladder`` (the parallel layouts and the lowest that fits) and
``suggest`` (what would fit when nothing does),
``traps`` (known ways to waste money). Pure Python: imports ``orchestrator.contract`` and
``providers`` (offers, never an SDK); never torch, never ``run/`` or ``cli/``.
"""
