"""``dtrun sample JOB``: parse, call ``trainer.sample``, print. Exit 2 when there is no
COMMITTED checkpoint, the data's tokenizer cannot be loaded here, or a job without a tokenizer
(``data: synthetic``, or no data-prepare manifest) is given a text prompt instead of token ids;
6 no such job."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from orchestrator.contract.errors import EXIT_OK, UsageError


def cmd_sample(job: str, prompt: str, tokens: int, temperature: float, step: int | None, num: int, seed: int) -> int:
    from orchestrator.cli.weights import data_manifest, resolve_job
    from trainer.export import ExportError
    from trainer.sample import samples
    from trainer.tokenizer import TokenizerError, from_manifest

    spec, run_uri = resolve_job(job)
    manifest, data_dir = data_manifest(spec)
    if not manifest:
        prompt_ids(job, spec, prompt)  # refuse a text prompt before the checkpoint is loaded
    try:
        tok = from_manifest(manifest, data_dir) if manifest else None
        at, texts = samples(run_uri, spec.trainer.model_spec, tok, prompt=prompt, tokens=tokens,
                            temperature=temperature, step=step, num=num, seed=seed)
    except (ExportError, TokenizerError) as e:
        raise UsageError(f"sample: {e}") from None
    if tok is None:
        print("(no data prepare manifest beside trainer.data: token ids shown)")
    for i, t in enumerate(texts):
        print(f"--- sample {i + 1} (step {at}, temperature {temperature}) ---")
        print(t)
    return EXIT_OK

def prompt_ids(job: str, spec, prompt: str) -> list[int]:
    """The prompt of a job without a tokenizer: whitespace-separated token ids below the vocabulary
    size, or a one-line ``UsageError`` (exit 2) saying why text cannot be used."""
    vocab = spec.trainer.model_spec.vocab_size
    why = ("its data is synthetic" if spec.trainer.data == "synthetic"
           else f"no data prepare manifest beside {spec.trainer.data}")
    words = prompt.split()
    bad = [w for w in words if not (w.isdigit() and int(w) < vocab)]
    if bad:
        raise UsageError(f"sample: {job} has no tokenizer ({why}): --prompt must be token ids "
                         f"0..{vocab - 1} separated by spaces, e.g. --prompt '1 2 3' (not {bad[0]!r})")
    return [int(w) for w in words]

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def sample(
    job: Annotated[str, typer.Argument(help="Job name (or its job.yaml).", show_default=False)],
    prompt: Annotated[str, typer.Option(help="Text to continue (token ids, e.g. '1 2 3', for a job without a tokenizer).")] = "",
    tokens: Annotated[int, typer.Option(help="Tokens to generate per sample.")] = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).")] = 0.8,
    step: Annotated[Optional[int], typer.Option(help="Checkpoint step (default: newest COMMITTED).")] = None,
    num: Annotated[int, typer.Option("--num", "-n", help="Samples.")] = 3,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Generate a few lines of text from a checkpoint with the data's tokenizer (CPU or GPU)."""
    raise typer.Exit(cmd_sample(job, prompt, tokens, temperature, step, num, seed))
