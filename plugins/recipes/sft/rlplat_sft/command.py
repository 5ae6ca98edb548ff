"""``rlplat sft``: supervised fine-tuning on the training engines; its export is ``rlplat run``'s ``model.path``."""

from __future__ import annotations

from typing import List, Optional

import typer

from rlplat.cli.command_line import CONFIG, ENGINE, OVERRIDES, fail


def sft(
    overrides: Optional[List[str]] = OVERRIDES,
    engine: Optional[str] = ENGINE,
    config: Optional[str] = CONFIG,
) -> None:
    """Fine-tune a model on demonstrations (parquet: messages, or prompt and response; the loss on the
    assistant's tokens), then write it as a Hugging Face folder for `rlplat run model.path=...`. The run
    directory holds the resolved config, metrics (JSONL, TensorBoard) and checkpoints."""
    from rlplat.config import check_before_start
    from rlplat.config_node import ConfigError
    from rlplat_sft.config import load_sft_config

    try:
        resolved = load_sft_config(config, list(overrides or []), engine=engine)
        check_before_start(resolved)
        from rlplat_sft.trainer import SFTTrainer

        trainer = SFTTrainer(resolved)  # reads and checks every data row before a worker starts
    except ConfigError as error:
        raise fail(str(error)) from None
    typer.echo(f"rlplat sft: run directory {trainer.run_dir}; {len(trainer.train_loader.dataset)} training examples, "
               f"{trainer.total_steps} steps", err=True)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    typer.echo(f"rlplat sft: done; metrics in {trainer.run_dir}/metrics.jsonl (`rlplat plot {trainer.run_dir}`); "
               f"the model is in {trainer.export_dir}: train it further with `rlplat run model.path={trainer.export_dir} ...`",
               err=True)
