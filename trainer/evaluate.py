"""Validation loss on held-out shards (``trainer.eval_every``, ``trainer.eval_tokens``).

The validation shards are ``trainer.val_data`` or, by default, the validation-named shards beside
``trainer.data`` (``val_000000.bin`` from ``dtrun data prepare``, llm.c's ``*_val_*.bin``); their
format is read with ``trainer.shards``. The validation stream is read *sequentially from its start*:
window ``i`` is tokens ``[i·T, i·T + T + 1)``. An evaluation covers ``rounds × dp × mb`` windows
(``rounds = max(1, eval_tokens // (T · dp · mb))``); round ``r`` gives data-parallel rank ``d`` the
windows ``r·dp·mb + d·mb + j``, so every rank runs the same number of forward passes (FSDP's
collectives line up) and the set of windows depends only on ``eval_tokens``, ``T``, ``dp·mb``.

The loss is the mean cross-entropy over every target token (sums and counts all-reduced in fp64):
the same checkpoint and layout give the same number. Tensor-parallel ranks of one group see the
same windows; their duplicate sums cancel in the mean.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from trainer import shards
from trainer.errors import ConfigError


def _fs_files(uri: str, only_val: bool) -> tuple[Any, list[str]]:
    import fsspec

    from orchestrator.contract.runuri import _fs

    fs, path = _fs(uri) if uri.startswith("s3://") else fsspec.core.url_to_fs(uri)
    if any(ch in path for ch in "*?["):
        files = fs.glob(path)
    elif fs.isdir(path):
        files = [f for f in fs.ls(path, detail=False) if f.endswith((".bin", ".npy"))]
    else:
        files = [path] if fs.exists(path) else []
    if only_val:
        files = [f for f in files if shards.is_validation(f)]
    return fs, sorted(files)


def validation_files(data: str, val_data: str | None) -> tuple[Any, list[str]] | None:
    """(filesystem, validation shard paths), or None when the job has none."""
    if val_data is None and data == "synthetic":
        return None
    uri = val_data or data
    uri = uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))
    if val_data is None:
        from trainer.prepare import manifest_dir

        uri = manifest_dir(uri)
    try:
        fs, files = _fs_files(uri, only_val=val_data is None)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"trainer.val_data: cannot list {uri}: {type(e).__name__}: {e}") from None
    if not files:
        if val_data is not None:
            raise ConfigError(f"trainer.val_data: no .bin or .npy token shards at {val_data}")
        return None
    return fs, files


class Evaluator:
    def __init__(self, fs: Any, files: list[str], *, seq_len: int, vocab_size: int, eval_tokens: int,
                 micro_batch: int, dp: int, dp_rank: int):
        self.T, self.mb, self.dp, self.dp_rank = seq_len, micro_batch, dp, dp_rank
        infos = []
        for f in files:
            try:
                infos.append(shards.read_info(fs, f))
            except shards.ShardFormatError as e:
                raise ConfigError(f"trainer.val_data: {e}") from None
        infos = [i for i in infos if i.n_tokens > 0]
        total = sum(i.n_tokens for i in infos)
        if total < seq_len + 1:
            raise ConfigError(f"trainer.val_data: the validation shards hold {total} tokens, fewer than "
                              f"seq_len + 1 ({seq_len + 1})")
        self.rounds = max(1, eval_tokens // (seq_len * dp * micro_batch))
        self.windows = self.rounds * dp * micro_batch
        self.available = (total - 1) // seq_len  # whole windows in the stream (wrapped around beyond)
        need = min(total, self.available * seq_len + 1)
        parts, left = [], need
        for info in infos:  # sequential read of the stream's prefix
            k = min(left, info.n_tokens)
            with fs.open(info.path, "rb") as fh:
                fh.seek(info.offset)
                parts.append(np.frombuffer(fh.read(k * info.dtype.itemsize), dtype=info.dtype))
            left -= k
            if left == 0:
                break
        self.stream = np.concatenate(parts).astype(np.int64)
        if int(self.stream.max()) >= vocab_size:
            raise ConfigError(f"trainer.val_data: token id {int(self.stream.max())} ≥ the model's vocab_size "
                              f"{vocab_size}")
        self.tokens = self.windows * seq_len  # target tokens per evaluation (whole job)

    def _window(self, i: int) -> np.ndarray:
        i %= self.available
        return self.stream[i * self.T:i * self.T + self.T + 1]

    def evaluate(self, model: Any, device: Any, amp: Any) -> float:
        """Mean validation cross-entropy (collective: every rank calls it)."""
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for r in range(self.rounds):
                first = r * self.dp * self.mb + self.dp_rank * self.mb
                arr = np.stack([self._window(first + j) for j in range(self.mb)])
                t = torch.from_numpy(arr).to(device)
                x, y = t[:, :-1], t[:, 1:]
                with amp():
                    logits = model(x)
                if hasattr(logits, "full_tensor"):
                    logits = logits.full_tensor()
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
                total[0] += loss.double()
                total[1] += y.numel()
        if dist.is_initialized():
            dist.all_reduce(total)
        if was_training:
            model.train()
        return float(total[0] / total[1])
