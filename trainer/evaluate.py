"""Validation loss on held-out shards (``trainer.eval_every``, ``trainer.eval_tokens``).

The validation shards are ``trainer.val_data`` or, by default, the validation-named shards beside
``trainer.data`` (``val_000000.bin`` from ``dtrun data prepare``, llm.c's ``*_val_*.bin``), read
through the training loader's ``ShardSource`` (``trainer.data.build_val_source``). The validation stream is read *sequentially from its start*:
window ``i`` is tokens ``[i·T, i·T + T + 1)``. An evaluation covers ``rounds × dp × mb`` windows
(``rounds = max(1, eval_tokens // (T · dp · mb))``); round ``r`` gives data-parallel rank ``d`` the
windows ``r·dp·mb + d·mb + j``, so every rank runs the same number of forward passes (FSDP's
collectives line up) and the set of windows depends only on ``eval_tokens``, ``T``, ``dp·mb``.

The loss is the mean cross-entropy over every target token (sums and counts all-reduced in fp64):
the same checkpoint and layout give the same number. Tensor-parallel ranks of one group see the
same windows; their duplicate sums cancel in the mean.
"""

from __future__ import annotations

from typing import Any

import numpy as np



class Evaluator:
    """Validation loss over a source from :func:`trainer.data.build_val_source` (its reads, block
    cache and vocabulary check are the training loader's)."""

    def __init__(self, source: Any, *, seq_len: int, eval_tokens: int, micro_batch: int, dp: int, dp_rank: int):
        self.source, self.T, self.mb, self.dp, self.dp_rank = source, seq_len, micro_batch, dp, dp_rank
        self.rounds = max(1, eval_tokens // (seq_len * dp * micro_batch))
        self.windows = self.rounds * dp * micro_batch
        total = getattr(source, "total", None)  # shards: whole windows in the stream (wrapped around beyond)
        self.available = (total - 1) // seq_len if total is not None else self.windows
        self.tokens = self.windows * seq_len  # target tokens per evaluation (whole job)

    def _window(self, i: int) -> np.ndarray:
        return self.source.sample(i % self.available)

    def check(self) -> None:
        """Read this rank's windows once at startup and agree across ranks (collective): a
        validation token id ≥ vocab_size is a ConfigError on *every* rank before step 1, not on the
        one rank whose windows hold it at the first evaluation (the others blocked in the
        all-reduce, no message from rank 0)."""
        import torch.distributed as dist

        from trainer.errors import ConfigError

        err = None
        try:
            for r in range(self.rounds):
                first = r * self.dp * self.mb + self.dp_rank * self.mb
                for j in range(self.mb):
                    self._window(first + j)
        except ConfigError as e:
            err = str(e)
        if dist.is_initialized():
            errs: list = [None] * dist.get_world_size()
            dist.all_gather_object(errs, err)
            err = next((x for x in errs if x is not None), None)
        if err is not None:
            raise ConfigError(err)

    def evaluate(self, model: Any, device: Any, amp: Any) -> float:
        """Mean validation cross-entropy (collective: every rank calls it)."""
        import torch
        import torch.distributed as dist

        from trainer.model import loss_context, loss_fn

        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for r in range(self.rounds):
                first = r * self.dp * self.mb + self.dp_rank * self.mb
                arr = np.stack([self._window(first + j) for j in range(self.mb)])
                t = torch.from_numpy(arr).to(device)
                x, y = t[:, :-1], t[:, 1:]
                cp = getattr(model, "cp", None)
                if cp is not None:  # context parallelism: this rank's slice of the sequence
                    x, y = cp.shard(x), cp.shard(y)
                # Under TP with an untied head the logits are vocab-sharded: loss parallel, as in
                # training (gathering them would hold mb·T·V logits per rank, tp× training's).
                with loss_context(model):
                    with amp():
                        logits = model(x)
                    # In chunks, as in training: no fp32 copy of the whole micro-batch's logits.
                    loss = loss_fn(logits, y)[1] * y.numel()
                if hasattr(loss, "full_tensor"):
                    loss = loss.full_tensor()
                total[0] += loss.double()
                total[1] += y.numel()
        if dist.is_initialized():
            dist.all_reduce(total)
        if was_training:
            model.train()
        return float(total[0] / total[1])
