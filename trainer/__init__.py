"""dtrun's bundled trainer (GPT/MoE, FSDP2/TP/EP, DCP checkpoints to the run URI).

It may import ``orchestrator.contract`` (the run URI it reads and writes, exit codes, GPU facts)
and ``orchestrator.plan`` (the job spec and model shapes it is given, pure Python) — nothing of
``run``, ``cli`` or ``providers``, because on a node the trainer runs with only the job file and
the run URI. Import nothing heavy here: the orchestrator imports this package on fast paths.

Some modules also run on the user's machine, behind the CLI: ``prepare`` and ``tokenizer``
(``dtrun data``; numpy and the tokenizer libraries, no torch), ``export`` (``dtrun weights``) and
``sample`` (``dtrun sample``), which reuse the trainer's model and checkpoint code.
"""
