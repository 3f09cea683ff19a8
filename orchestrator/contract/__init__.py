"""The bottom layer, shared by the orchestrator, the providers, the node bootstrap and the trainer.

- ``runuri`` — the run-URI contract between controller and trainer: paths, markers
  (COMMITTED, STOP, DONE, lease), exit codes of the node.
- ``errors`` — dtrun's error hierarchy and the CLI's exit codes, turned into messages in one place.
- ``gpus`` — GPU names and facts (memory, peak FLOP/s): the vocabulary the spec, the providers'
  offers and the trainer's MFU share.

Imports nothing of dtrun (standard library only), so anything may import it.
"""
