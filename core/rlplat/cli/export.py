"""``rlplat export CHECKPOINT --out DIR [--step N] [--adapter] [actor.engine_config.KEY=VALUE ...]``: a run's
trained model as a Hugging Face folder.

The run is one ``rlplat run`` (RL: its policy, the actor) or another registered command wrote (``rlplat
sft``, from rlplat-sft): which one is read from the resolved config it wrote (``config.yaml``), whose
top-level nodes are that command's. A command declares the runs it writes in its registration's metadata
(:data:`RUN_CONFIG`, :data:`ENGINE_NODE`), so the export knows a plugin's runs without importing it. The
actor's engine is built in this process as the run built it (on a one-process group), loads the
checkpoint's ``actor`` folder and writes either the full model with the adapter merged in when the run
trained LoRA (a ``save_pretrained`` folder with the tokenizer, so ``rlplat run model.path=DIR`` or plain
``transformers`` loads it) or, with ``--adapter``, the LoRA adapter alone (the folder
``peft.PeftModel.from_pretrained`` loads over the base model). The folder is written beside ``--out``
and moved into place once complete, so a failed export leaves nothing behind.

``actor.engine_config.KEY=VALUE`` arguments change the engine's own keys for the export: a run trained
on several processes in a parallel layout (megatron's tensor or pipeline parallelism) is exported from
one process with a one-process layout, when the engine's checkpoints load into another layout
(megatron's do: ``actor.engine_config.tensor_parallel_size=1 actor.engine_config.pipeline_parallel_size=1``).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import typer

CONFIG_FILE = "config.yaml"
ACTOR_FOLDER = "actor"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"rlplat export: {message}", err=True)
    return typer.Exit(code)


def find_checkpoint(path: Path, step: Optional[int] = None) -> tuple[Path, Path]:
    """``(checkpoint directory, run directory)`` from a checkpoint (``<run>/checkpoints/global_step_N``),
    a run's ``checkpoints`` folder or a run directory (their newest complete checkpoint, or the one of
    ``step``)."""
    from rlplat.trainer.checkpoint import CHECKPOINT_NAME, COMPLETE_MARKER, CheckpointManager, checkpoint_name, checkpoint_problem

    if not path.exists():
        raise fail(f"{path} does not exist; pass a checkpoint (RUN/checkpoints/global_step_N) or a run directory")
    if not path.is_dir():
        raise fail(f"{path} is not a directory; pass a checkpoint (RUN/checkpoints/global_step_N) or a run directory")
    if CHECKPOINT_NAME.fullmatch(path.name) or (path / COMPLETE_MARKER).exists():
        if step is not None:
            raise fail(f"--step {step} with the checkpoint {path}: pass the run directory with --step, or the checkpoint alone")
        problem = checkpoint_problem(path)
        if problem is not None:
            raise fail(f"checkpoint {path} {problem}; export a complete one (pass the run directory for its newest)")
        return path, path.parent.parent
    root = path if path.name == "checkpoints" else path / "checkpoints"
    manager = CheckpointManager(root)
    if step is not None:
        steps = sorted(checkpoint.step for checkpoint in manager.checkpoints())
        if step not in steps:
            saved = f"the complete ones are of steps {', '.join(map(str, steps))}" if steps else "it holds none"
            raise fail(f"--step {step}: {root} has no complete checkpoint of that step; {saved}")
        chosen = root / checkpoint_name(step)
        if checkpoint_problem(chosen) is not None:  # the step survives only as its replaced copy
            chosen = next(checkpoint.path for checkpoint in manager.checkpoints() if checkpoint.step == step)
        return chosen, root.parent
    latest = manager.latest()
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


RUN_CONFIG = "run_config"
"""Metadata key of a command's registration (kind ``command``): what the resolved config its runs write
holds, as ``"module:attribute"``: its dataclass, or a function of no arguments returning its defaults (a
mapping of its top-level nodes: ``rlplat run``'s, with the nodes plugins own); commands without it write
no exportable runs."""
ENGINE_NODE = "engine_node"
"""Metadata key beside :data:`RUN_CONFIG`: ``"module:function"``, called as ``function(config, total_steps)``
with such a run's config, returning the actor engine's build config (what the engine factory receives)."""


def actor_engine_node(config: Any, total_steps: int) -> dict[str, Any]:
    """``rlplat run``'s :data:`ENGINE_NODE`: the actor's engine node (:func:`rlplat.config.engine_node`)."""
    from rlplat.config import engine_node

    return engine_node(config, "actor", total_steps)


def run_commands() -> dict[str, Any]:
    """Command name -> registry entry, for every registered command whose runs can be exported (its
    metadata names :data:`RUN_CONFIG` and :data:`ENGINE_NODE`), ``run`` first."""
    from rlplat import registry

    entries = [entry for entry in registry.entries("command")
               if entry.metadata.get(RUN_CONFIG) and entry.metadata.get(ENGINE_NODE)]
    return {entry.name: entry for entry in sorted(entries, key=lambda entry: (entry.name != "run", entry.name))}


def run_kind(config: Any, config_path: Path) -> str:
    """The command whose resolved config ``config`` is (a key of :func:`run_commands`). Each command
    writes every node of its schema; a config is that command's when all its nodes are the schema's and it
    has a node only that command has (``rlplat sft``'s ``loss``; ``rlplat run``'s ``rollout``,
    ``algorithm``, ...). With one exportable command, all its nodes and ``model`` and ``actor``."""
    from omegaconf import DictConfig

    from rlplat.registry import resolve_dotted_path

    nodes = set(config) if isinstance(config, DictConfig) else set()
    schemas = {}
    for name, entry in run_commands().items():
        try:
            found = resolve_dotted_path(entry.metadata[RUN_CONFIG])
            schemas[name] = ({field.name for field in dataclasses.fields(found)} if dataclasses.is_dataclass(found)
                             else {str(node) for node in found()})
        except Exception as error:  # a plugin's metadata naming what does not load: say whose
            raise fail(f"the command {name!r} from {entry.origin} names its run config {entry.metadata[RUN_CONFIG]!r}, "
                       f"which does not load: {error}")
    for name, schema in schemas.items():
        own = set().union(*(schema - other for other_name, other in schemas.items() if other_name != name))
        if nodes and nodes <= schema and (nodes & own or len(schemas) == 1) and {"model", "actor"} <= nodes:
            return name
    described = "; ".join(f"rlplat {name} writes {', '.join(sorted(schema))}" for name, schema in schemas.items())
    raise fail(f"{config_path} is not the config of a run any installed command writes "
               f"({', '.join(f'rlplat {name}' for name in schemas)}; a plugin's command needs that plugin installed): "
               f"its top-level nodes are {', '.join(sorted(map(str, nodes))) or 'none'} ({described}); pass the "
               "directory of a run one of them wrote")


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


ENGINE_CONFIG_PREFIX = "actor.engine_config."


def apply_engine_overrides(config: Any, overrides: list[str]) -> list[str]:
    """Set each ``actor.engine_config.KEY=VALUE`` of ``overrides`` in ``config`` (values parsed as YAML, as
    the commands' overrides are); returns them as given. Anything else is refused."""
    from omegaconf import OmegaConf

    for override in overrides:
        key, equals, _ = override.partition("=")
        if not equals or not key.startswith(ENGINE_CONFIG_PREFIX) or key == ENGINE_CONFIG_PREFIX:
            raise fail(f"{override!r}: the export takes only the engine's own keys, as {ENGINE_CONFIG_PREFIX}KEY=VALUE "
                       "(e.g. a one-process layout for a run trained in a parallel one); the rest of the run's config is "
                       "what the checkpoint was trained with")
    if overrides:
        try:
            node = OmegaConf.from_dotlist(overrides)
        except Exception as error:
            raise fail(f"cannot read {' '.join(overrides)}: {error}")
        config.actor.engine_config = OmegaConf.merge(config.actor.engine_config, node.actor.engine_config)
    return overrides


def build_engine(config: Any, kind: str, step: int) -> Any:
    """The actor's engine as a run of the command ``kind`` built it, before its checkpoint is loaded."""
    from rlplat.registry import EngineRegistry, resolve_dotted_path

    # the learning-rate schedule's length only matters to training; the checkpoint restores its state
    total_steps = int(config.trainer.total_training_steps or max(step, 1))
    node = resolve_dotted_path(run_commands()[kind].metadata[ENGINE_NODE])(config, total_steps)
    engine = EngineRegistry("engine").build(config.actor.engine, node)
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
    step: Optional[int] = typer.Option(None, "--step", help="With a run directory: export its complete checkpoint "
                                                          "of this step instead of the newest."),
    adapter: bool = typer.Option(False, "--adapter", help="Write the LoRA adapter alone (adapter_config.json and "
                                                          "adapter_model.safetensors) instead of the merged model."),
    force: bool = typer.Option(False, "--force", help="Replace --out when it exists and is not empty."),
    engine_overrides: Optional[list[str]] = typer.Argument(
        None, metavar="[actor.engine_config.KEY=VALUE]...", help="The engine's own keys changed for the export, e.g. a "
        "one-process layout for a megatron run trained with tensor or pipeline parallelism: "
        "actor.engine_config.tensor_parallel_size=1 actor.engine_config.pipeline_parallel_size=1."),
) -> None:
    """Write the model an `rlplat run` (its policy) or `rlplat sft` run trained as a Hugging Face model
    folder (LoRA merged in), or its LoRA adapter with --adapter; prints the folder written."""
    checkpoint_dir, run_dir = find_checkpoint(checkpoint, step)
    check_out(out, force)
    if not (checkpoint_dir / ACTOR_FOLDER).is_dir():
        raise fail(f"checkpoint {checkpoint_dir} has no {ACTOR_FOLDER}/ folder: it holds no actor weights to export")
    config = read_run_config(run_dir)
    kind = run_kind(config, run_dir / CONFIG_FILE)
    check_model(config, run_dir / CONFIG_FILE, adapter)
    changed = apply_engine_overrides(config, list(engine_overrides or []))

    from rlplat.trainer.checkpoint import CheckpointManager
    from rlplat.config_node import ConfigError
    from rlplat.controller.host import WorkerHost, free_port

    saved_step = int(CheckpointManager(checkpoint_dir.parent).load_state(checkpoint_dir)["step"])
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    host = WorkerHost(rank=0, world_size=1)
    try:
        import torch

        host.init_distributed("127.0.0.1", free_port(), use_gpu=torch.cuda.is_available())
        try:
            engine = build_engine(config, kind, saved_step)
        except ConfigError as error:  # an engine key of the run's config or of the arguments: the engine names it
            raise fail(f"the {config.actor.engine} engine of {run_dir / CONFIG_FILE}"
                       f"{' with ' + ' '.join(changed) if changed else ''}: {error}")
        except ValueError as error:  # a layout that needs more processes than this one: the engine says which
            raise fail(f"cannot build the {config.actor.engine} engine of {run_dir / CONFIG_FILE} in this one process: "
                       f"{error}. rlplat export builds the engine on one process: give it a one-process layout with "
                       f"{ENGINE_CONFIG_PREFIX}KEY=VALUE arguments (megatron: {ENGINE_CONFIG_PREFIX}tensor_parallel_size=1 "
                       f"{ENGINE_CONFIG_PREFIX}pipeline_parallel_size=1)")
        try:
            engine.load(str(checkpoint_dir / ACTOR_FOLDER))
        except Exception as error:  # the engine names the file and the mismatch
            raise fail(f"cannot load {checkpoint_dir / ACTOR_FOLDER} into the {config.actor.engine} engine built from "
                       f"{run_dir / CONFIG_FILE}{' with ' + ' '.join(changed) if changed else ''}: {error}")
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
    typer.echo(f"rlplat export: wrote the {what} of {checkpoint_dir} (step {saved_step}), trained by "
               f"rlplat {kind}, to {out}", err=True)
    typer.echo(str(out))
