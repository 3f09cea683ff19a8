"""The bottom layer, shared by the orchestrator, the providers, the node bootstrap and the trainer.

- ``runuri`` — the run-URI contract between controller and trainer: paths, markers
  (COMMITTED, STOP, DONE, lease), exit codes of the node.
- ``errors`` — dtrun's error hierarchy and the CLI's exit codes, turned into messages in one place.
- ``gpus`` — GPU names and facts (memory, peak FLOP/s): the vocabulary the spec, the providers'
  offers and the trainer's MFU share.
- ``nodeenv`` — the node environment: every ``DTRUN_*`` name a node reads, the typed record, to and
  from the environment, the bootstrap's command line; the controller, ``dtrun export`` and the node
  all go through it.
- ``dataset`` — the data contract: the shard listing (train and ``val_*`` shards) and the
  data-prepare manifest, read by the trainer and checked by the controller before renting.
- ``storeprobe`` — the run-URI write/read/list/delete probe and its words for each failure.

Imports nothing of dtrun (standard library only), so anything may import it.
"""
