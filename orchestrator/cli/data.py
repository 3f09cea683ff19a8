"""``dtrun data prepare`` and ``dtrun data tokenizer``: parse, call ``trainer.prepare``, print.

Exit codes: 0 done, 2 bad input (unknown tokenizer, empty corpus, unreadable file; nothing is
left half-written under ``--out``), 130 interrupted (finished shards are kept: rerun to resume).
"""

from __future__ import annotations

import sys
import time
from typing import Annotated, Optional

import typer

from orchestrator.contract.errors import EXIT_OK, UsageError


def cmd_prepare(source: str, out: str, tokenizer: str, val_tokens: int | None, shard_tokens: int, workers: int | None,
                text_field: str, quiet: bool) -> int:
    from trainer.prepare import PrepareError, prepare
    from trainer.tokenizer import TokenizerError

    bar = _Bar(enabled=not quiet)
    try:
        with bar:
            m = prepare(source, out, tokenizer=tokenizer, val_tokens=val_tokens, shard_tokens=shard_tokens,
                        workers=workers, text_field=text_field, on_progress=bar.update)
    except (PrepareError, TokenizerError) as e:
        raise UsageError(f"data prepare: {e}; nothing written under {out}") from None
    how = "" if val_tokens is not None else " (--val-tokens default: a tenth of the corpus, at most 1,000,000)"
    print(f"{out}: {m['train']['tokens']:,} training tokens in {len(m['train']['shards'])} shard(s), "
          f"{m['val']['tokens']:,} validation tokens{how}, {m['documents']:,} documents; tokenizer "
          f"{m['tokenizer']['name']} (vocabulary {m['vocab_size']:,}, {m['dtype']})")
    print(f"  train on it with   trainer: {{data: {out}}}   (validation shards are found beside it)")
    return EXIT_OK


def cmd_tokenizer(source: str, vocab_size: int, out: str, text_field: str = "text") -> int:
    from trainer.prepare import PrepareError, iter_documents, plan_units
    from trainer.tokenizer import TokenizerError, train_bpe

    try:
        _, sources, _ = plan_units(source, text_field)  # every source `data prepare` reads, checked first
        t0 = time.monotonic()
        tok = train_bpe(iter_documents(source, text_field), vocab_size, out, files=False)
    except (PrepareError, TokenizerError) as e:
        raise UsageError(f"data tokenizer: {e}") from None
    print(f"{out}: byte-level BPE, vocabulary {tok.vocab_size:,}, trained on {len(sources)} source(s) in "
          f"{time.monotonic() - t0:.1f} s")
    if tok.vocab_size < vocab_size:
        print(f"warning: asked for a vocabulary of {vocab_size:,} but the corpus supports only {tok.vocab_size:,} "
              f"(every merge seen in it was learned); a model's vocab_size of {tok.vocab_size:,} is enough, "
              "or train on more text", file=sys.stderr)
    return EXIT_OK


class _Bar:
    """A rich progress bar over input bytes: documents, tokens, MB/s, ETA (plain lines without a terminal)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.progress = None
        self.task = None
        self._last = 0.0

    def __enter__(self):
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                                     TextColumn("{task.fields[info]}"), TextColumn("ETA"), TimeRemainingColumn(),
                                     console=Console(stderr=True))
            self.task = self.progress.add_task("prepare", total=None, info="")
            self.progress.__enter__()
        return self

    def __exit__(self, *a):
        if self.progress is not None:
            self.progress.__exit__(*a)

    def update(self, p) -> None:
        if not self.enabled:
            return
        dt = max(1e-9, time.monotonic() - self.t0)
        info = f"{p.docs:,} docs · {p.tokens:,} tokens · {p.bytes_done / dt / 1e6:.1f} MB/s · {p.shards} shard(s)"
        if self.progress is not None:
            self.progress.update(self.task, total=p.bytes_total, completed=p.bytes_done, info=info)
        elif time.monotonic() - self._last >= 5 or p.bytes_done >= p.bytes_total:
            self._last = time.monotonic()
            pct = 100 * p.bytes_done / p.bytes_total if p.bytes_total else 0
            sys.stderr.write(f"tokenizing {pct:5.1f}%  {info}\n")
            sys.stderr.flush()

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


data_app = typer.Typer(name="data", help="Prepare training data: token shards, a validation split, a manifest.",
                       no_args_is_help=True, rich_markup_mode=None)
app.add_typer(data_app)


@data_app.command("prepare")
def data_prepare(
    source: Annotated[str, typer.Argument(help="Text/JSONL/Parquet file, folder or glob; a datasets folder "
                                         "(save_to_disk) or hf:NAME[:SPLIT].", show_default=False)],
    out: Annotated[str, typer.Option("--out", help="Output folder or URI (s3://…).", show_default=False)],
    tokenizer: Annotated[str, typer.Option(help="gpt2 (tiktoken), a tokenizer.json path, or a cached HF repo id.")] = "gpt2",
    val_tokens: Annotated[Optional[int], typer.Option(
        help="Tokens held out for validation (default: a tenth of the corpus, at most 1,000,000).",
        show_default=False)] = None,
    shard_tokens: Annotated[int, typer.Option(help="Tokens per shard file.")] = 100_000_000,
    workers: Annotated[Optional[int], typer.Option(help="Tokenizer processes (default: every core).")] = None,
    text_field: Annotated[str, typer.Option(help="JSONL field / Parquet column holding the text.")] = "text",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Tokenize a corpus into llm.c shards with a validation split and a manifest (resumable)."""
    raise typer.Exit(cmd_prepare(source, out, tokenizer, val_tokens, shard_tokens, workers, text_field, quiet))


@data_app.command("tokenizer")
def data_tokenizer(
    source: Annotated[str, typer.Argument(help="What `data prepare` reads: text/JSONL/Parquet file, folder or "
                                         "glob; a datasets folder or hf:NAME[:SPLIT].", show_default=False)],
    out: Annotated[str, typer.Option("--out", help="Where to write tokenizer.json.", show_default=False)],
    vocab_size: Annotated[int, typer.Option(help="Vocabulary size.")] = 4096,
    text_field: Annotated[str, typer.Option(help="JSONL field / Parquet column holding the text.")] = "text",
) -> None:
    """Train a byte-level BPE tokenizer on a corpus (seconds for a few MB); use it with --tokenizer."""
    raise typer.Exit(cmd_tokenizer(source, vocab_size, out, text_field))
