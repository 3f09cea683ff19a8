"""dtrun's bundled trainer (GPT/MoE, FSDP2/TP/EP, DCP checkpoints to the run URI).

It may import ``orchestrator.contract`` (the run URI it reads and writes, exit codes, GPU facts)
and ``orchestrator.plan`` (the job spec and model shapes it is given, pure Python) — nothing of
``run``, ``cli`` or ``providers``, because on a node the trainer runs with only the job file and
the run URI. Import nothing heavy here: the orchestrator imports this package on fast paths.
"""
