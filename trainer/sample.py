"""``dtrun sample``: a few continuations from a checkpoint, with the data's tokenizer.

The full model is assembled on this machine (``trainer.export.load_model_from_checkpoint``), on
CUDA when there is one, else the CPU. Plain autoregressive sampling (no KV cache: the models this
is for are small, and it keeps one forward path, the trainer's): the context is cut to
``max_seq_len``; temperature 0 is greedy; a seeded generator makes a run repeatable.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def generate(model: Any, prompt_ids: list[int], *, tokens: int, temperature: float, seed: int,
             max_seq_len: int, stop: int | None = None) -> list[int]:
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    out: list[int] = []
    for _ in range(tokens):
        logits = model(ids[:, -max_seq_len:])[0, -1].float()
        if temperature <= 0:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=g))
        if stop is not None and nxt == stop and out:
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=dev)], dim=1)
    return out


def samples(run_uri: str, ms: Any, tok: Any, *, prompt: str, tokens: int, temperature: float, step: int | None,
            num: int, seed: int) -> tuple[int, list[str]]:
    """(checkpoint step, ``num`` generated texts)."""
    from trainer.export import load_model_from_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, at = load_model_from_checkpoint(run_uri, ms, step, device=device)
    if tok is not None:
        pids = tok.encode(prompt) if prompt else []
        if tok.eot is not None:
            pids = [tok.eot] + pids  # documents start after an end-of-text token (data prepare)
    else:
        pids = [int(x) for x in prompt.split()] if prompt else [0]
    pids = pids or [0]
    texts = []
    for i in range(num):
        ids = generate(model, pids, tokens=tokens, temperature=temperature, seed=seed + i,
                       max_seq_len=ms.max_seq_len, stop=tok.eot if tok is not None else None)
        texts.append(prompt + tok.decode(ids) if tok is not None else " ".join(map(str, ids)))
    return at, texts
