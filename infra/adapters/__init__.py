"""Small optional helpers a user's training script imports on the node (``command:`` jobs).

None of them imports the orchestrator; each needs only its framework. See docs/user-code.md
for the contract they implement:

* :mod:`infra.adapters.hf` — a Hugging Face ``TrainerCallback``: SIGTERM → save now, then stop
  (exit 75); progress lines the node reads.
* :mod:`infra.adapters.marker` — ``done_writing(folder, step)`` and ``progress(step, ...)`` for
  any script (standard library only); ``resume_dir()`` finds what dtrun restored.
"""
