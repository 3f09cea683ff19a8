"""Checks on ``trainer.data`` made on the user's machine before anything is rented.

``check_data_vocab``: when ``trainer.data`` is ``dtrun data prepare`` output, its manifest names the
tokenizer's vocabulary size; a model whose ``vocab_size`` is smaller would index past its
embedding on the first batch holding a high token id (on a GPU: a device-side assert after the
node was paid for). Refused here with exit 2 (``SpecError``). The trainer repeats the check
(``trainer.train.check_data_vocab``) for runs started without ``dtrun up``.
"""

from __future__ import annotations

from orchestrator.contract.dataset import read_manifest
from orchestrator.contract.errors import SpecError


def check_data_vocab(spec, source: str = "job", remote: bool = True) -> None:
    """``remote=False`` (the dry run, which must stay fast and import no storage SDK) checks only
    a manifest on this machine's disk; ``dtrun up`` reads it wherever it is."""
    t = spec.trainer
    if t is None:  # a command job: its data is its own business
        return
    for data in (t.data, t.val_data):  # the validation shards are indexed into the same embedding
        if data is None or (not remote and "://" in data and not data.startswith("file://")):
            continue
        m = read_manifest(data)
        if not m:
            continue
        need = int(m.get("vocab_size") or 0)
        have = t.model_spec.vocab_size
        if need > have:
            tok = (m.get("tokenizer") or {}).get("name")
            raise SpecError(f"{source}: trainer.model: vocab_size {have} is smaller than the vocabulary of the data's "
                            f"tokenizer ({tok}: {need} tokens, manifest beside {data}); token ids ≥ {have} would "
                            f"index past the embedding. Use a model with vocab_size ≥ {need}; nothing rented")
