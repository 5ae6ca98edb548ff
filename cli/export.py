"""``rlplat export CHECKPOINT --out DIR [--adapter]``: a run's trained policy as a Hugging Face folder.

The actor's engine is built in this process as the run built it (from the run's ``config.yaml``, on a
one-process group), loads the checkpoint's ``actor`` folder and writes either the full model with the
adapter merged in when the run trained LoRA (a ``save_pretrained`` folder with the tokenizer, so
``rlplat run model.path=DIR`` or plain ``transformers`` loads it) or, with ``--adapter``, the LoRA
adapter alone (the folder ``peft.PeftModel.from_pretrained`` loads over the base model). The folder is
written beside ``--out`` and moved into place once complete, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import typer

CONFIG_FILE = "config.yaml"
ACTOR_FOLDER = "actor"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"rlplat export: {message}", err=True)
    return typer.Exit(code)


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """``(checkpoint directory, run directory)`` from a checkpoint (``<run>/checkpoints/global_step_N``),
    a run's ``checkpoints`` folder or a run directory (their newest complete checkpoint)."""
    from rlplat.checkpoint import CHECKPOINT_NAME, COMPLETE_MARKER, CheckpointManager, checkpoint_problem

    if not path.exists():
        raise fail(f"{path} does not exist; pass a checkpoint (RUN/checkpoints/global_step_N) or a run directory")
    if not path.is_dir():
        raise fail(f"{path} is not a directory; pass a checkpoint (RUN/checkpoints/global_step_N) or a run directory")
    if CHECKPOINT_NAME.fullmatch(path.name) or (path / COMPLETE_MARKER).exists():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise fail(f"checkpoint {path} {problem}; export a complete one (pass the run directory for its newest)")
        return path, path.parent.parent
    root = path if path.name == "checkpoints" else path / "checkpoints"
    latest = CheckpointManager(root).latest()
    if latest is None:
        raise fail(f"{path} holds no complete checkpoint (looked under {root}); a run writes them every "
                   "trainer.save_freq steps and at its end")
    return latest, root.parent


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise fail(f"--out {out} is a file; pass a directory to write the model into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise fail(f"--out {out} exists and is not empty; pass --force to replace it, or choose another directory")


def read_run_config(run_dir: Path) -> Any:
    config_path = run_dir / CONFIG_FILE
    if not config_path.is_file():
        raise fail(f"{config_path} does not exist; the trainer writes the run's resolved config there when a "
                   "run starts, and the export builds the actor's engine from it")
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(config_path)
    except Exception as error:  # a hand-edited or truncated file: say which and why
        raise fail(f"cannot read {config_path}: {error}")


def check_model(config: Any, config_path: Path, adapter: bool) -> None:
    from omegaconf import OmegaConf

    from rlplat.lora import read_lora

    model_path = OmegaConf.select(config, "model.path")
    if model_path is None or not Path(str(model_path)).is_dir():
        raise fail(f"model.path={model_path} in {config_path} is not a directory; the export builds the base "
                   "model from it (run the export where the run's model folder is)")
    node = OmegaConf.select(config, "actor.lora")
    lora = read_lora(OmegaConf.to_container(node, resolve=True) if node is not None else None)
    if adapter and not lora.enabled:
        raise fail(f"--adapter: the run trained the full model, without LoRA (actor.lora.rank=0 in {config_path}), "
                   "so there is no adapter; export the model without --adapter")


def build_engine(config: Any, step: int) -> Any:
    from rlplat.config import engine_node
    from rlplat.registry import EngineRegistry

    # the learning-rate schedule's length only matters to training; the checkpoint restores its state
    total_steps = int(config.trainer.total_training_steps or max(step, 1))
    engine = EngineRegistry("engine").build(config.actor.engine, engine_node(config, "actor", total_steps))
    engine.init_model()
    return engine


def write_tokenizer(config: Any, folder: Path) -> None:
    """The run's tokenizer beside the model, unless the engine wrote it already."""
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(config.model.tokenizer_path or config.model.path)).save_pretrained(str(folder))


def export(
    checkpoint: Path = typer.Argument(..., help="A checkpoint (RUN/checkpoints/global_step_N, with COMPLETE) or a run "
                                                "directory (its newest complete checkpoint)."),
    out: Path = typer.Option(..., "--out", help="Directory to write; must not exist or be empty (see --force)."),
    adapter: bool = typer.Option(False, "--adapter", help="Write the LoRA adapter alone (adapter_config.json and "
                                                          "adapter_model.safetensors) instead of the merged model."),
    force: bool = typer.Option(False, "--force", help="Replace --out when it exists and is not empty."),
) -> None:
    """Write a run's trained policy as a Hugging Face model folder (LoRA merged in), or its LoRA adapter
    with --adapter; prints the folder written."""
    checkpoint_dir, run_dir = find_checkpoint(checkpoint)
    check_out(out, force)
    if not (checkpoint_dir / ACTOR_FOLDER).is_dir():
        raise fail(f"checkpoint {checkpoint_dir} has no {ACTOR_FOLDER}/ folder: it holds no actor weights to export")
    config = read_run_config(run_dir)
    check_model(config, run_dir / CONFIG_FILE, adapter)

    from rlplat.checkpoint import CheckpointManager
    from rlplat.controller.host import WorkerHost, free_port

    step = int(CheckpointManager(checkpoint_dir.parent).load_state(checkpoint_dir)["step"])
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    host = WorkerHost(rank=0, world_size=1)
    try:
        import torch

        host.init_distributed("127.0.0.1", free_port(), use_gpu=torch.cuda.is_available())
        engine = build_engine(config, step)
        try:
            engine.load(str(checkpoint_dir / ACTOR_FOLDER))
        except Exception as error:  # the engine names the file and the mismatch
            raise fail(f"cannot load {checkpoint_dir / ACTOR_FOLDER} into the {config.actor.engine} engine built from "
                       f"{run_dir / CONFIG_FILE}: {error}")
        if adapter:
            engine.export_adapter(str(partial))
        else:
            engine.export_hf(str(partial))
            write_tokenizer(config, partial)
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    finally:
        host.shutdown()
        shutil.rmtree(partial, ignore_errors=True)
    what = "LoRA adapter" if adapter else "model"
    typer.echo(f"rlplat export: wrote the {what} of {checkpoint_dir} (step {step}) to {out}", err=True)
    typer.echo(str(out))
