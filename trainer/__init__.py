"""dtrun's bundled trainer (GPT/MoE, FSDP2/TP/EP, DCP checkpoints to the run URI).

Import nothing heavy here: the orchestrator imports this package on fast paths.
"""
