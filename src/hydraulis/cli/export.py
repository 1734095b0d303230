"""`hydraulis export`: a training checkpoint as a Hugging Face directory of its model family, with its tokenizer."""

from __future__ import annotations

from pathlib import Path

import typer

from hydraulis.cli.app import app


@app.command("export")
def export(
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", "-c", help="A checkpoint directory (step-NNNNNN), or a run directory (its newest one)."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="HF directory to write (config, weights, tokenizer)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    max_positions: int | None = typer.Option(
        None, "--max-positions", help="max_position_embeddings to advertise (default: the source model's, or 4096)."
    ),
    no_tokenizer: bool = typer.Option(
        False, "--no-tokenizer", help="Export without the tokenizer (else a run's tokenizer that is gone is refused)."
    ),
    no_source_config: bool = typer.Option(
        False, "--no-source-config", help="Export without the init_from model's config fields (pad_token_id, ...)."
    ),
) -> None:
    """Assemble the full fp32 model of a checkpoint on one process and write it for transformers."""
    from hydraulis.checkpoints.export import export_hf

    export_hf(checkpoint, out, force=force, max_position_embeddings=max_positions, log=typer.echo,
              tokenizer=not no_tokenizer, source_config=not no_source_config)
