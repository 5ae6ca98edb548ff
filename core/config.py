"""The run's config: typed OmegaConf structured configs, a docstring per field, validated before any
worker starts.

``load_config(config_file, overrides, algo=..., engine=..., rollout=...)`` builds it in this order:
the defaults below, then the chosen algorithm's defaults (its spec's ``default_config``: the
``algorithm`` node, and the ``actor`` / ``critic`` / ``reward`` settings it implies), then the YAML
file, then the dotted ``key=value`` overrides. A misspelled key, an unknown plugin, batch sizes that do
not divide, an algorithm that needs a critic without one, or a missing model or data path raises
:class:`ConfigError`: one paragraph saying what, where, and the closest valid choice.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from rlplat.data import DataConfig


class ConfigError(ValueError):
    """A config problem, explained in one paragraph for the person who wrote the config."""


@dataclasses.dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local Hugging Face directory of the policy (weights, config.json, and its tokenizer beside it)."""
    tokenizer_path: Optional[str] = None
    """Directory of the tokenizer; defaults to ``model.path``."""


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    betas: List[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_scheduler_type: str = "constant"
    """``constant`` or ``cosine`` after warm-up."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule, as a fraction of ``lr``."""
    grad_clip: Optional[float] = 1.0
    """Clip the global gradient norm (None: no clipping)."""


@dataclasses.dataclass
class ActorConfig:
    engine: str = "fsdp2"
    """Registered training engine (kind ``engine``) of the actor and the reference model."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (each brings ``rollout.n`` responses), as in verl."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    micro_batch_size_per_gpu: int = 8
    """Responses per micro-batch when ``use_dynamic_bsz`` is off."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget instead of a row count."""
    max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch under ``use_dynamic_bsz``."""
    loss: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The algorithm's actor-loss settings (``clip_ratio``, ``loss_agg_mode``, ``use_kl_loss``,
    ``kl_loss_coef``, ``entropy_coeff``, ...); the algorithm's defaults fill what is not set."""
    engine_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """More keys of the engine's own node (e.g. ``enable_gradient_checkpointing``)."""


@dataclasses.dataclass
class CriticConfig(ActorConfig):
    enable: Optional[bool] = None
    """Build a critic: None follows the algorithm (PPO needs one); False with such an algorithm is an error."""


@dataclasses.dataclass
class RolloutConfig:
    name: str = "hf"
    """Registered rollout engine (kind ``rollout``)."""
    n: int = 1
    """Responses sampled per prompt."""
    response_length: int = 128
    """Maximum new tokens per response."""
    temperature: float = 1.0
    """Sampling temperature (the actor's log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""
    top_k: int = 0
    """Top-k filter (0: off)."""
    val_greedy: bool = True
    """Validation samples greedily, one response per prompt."""
    free_between_phases: bool = False
    """Put the rollout to sleep after each generation and wake it (weights, then KV cache) at the next
    weight sync, so that training has its memory: what a colocated vllm or sglang rollout on a GPU needs."""
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """More keys of the rollout's own node."""


@dataclasses.dataclass
class CustomFunctionConfig:
    path: Optional[str] = None
    """Python file defining the reward function."""
    name: str = "compute_score"
    """Function in that file: ``score(data_source, solution_str, ground_truth, extra_info)``."""


@dataclasses.dataclass
class RewardConfig:
    manager: str = "naive"
    """Registered reward manager (kind ``reward_manager``)."""
    scorer: Optional[str] = None
    """Registered scorer (kind ``reward_scorer``); None with no custom function uses the demo's exact match."""
    custom_function: CustomFunctionConfig = dataclasses.field(default_factory=CustomFunctionConfig)
    """A scorer from a file instead of a registered one."""
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The reward manager's own settings (``fallback_score``, ``timeout_s``, overlong buffer, ...)."""


@dataclasses.dataclass
class TrainerConfig:
    total_training_steps: Optional[int] = None
    """Steps to train; None: ``total_epochs`` passes over the training data."""
    total_epochs: int = 1
    """Passes over the training data when ``total_training_steps`` is None."""
    save_freq: int = 0
    """Save a checkpoint every this many steps (0: only at the end and on Ctrl-C)."""
    keep_last: int = 3
    """Complete checkpoints kept."""
    test_freq: int = 0
    """Validate every this many steps (0: never during training)."""
    val_before_train: bool = True
    """Validate once before the first step (when a validation set is given)."""
    output_dir: str = "runs/rlplat"
    """Run directory: resolved config, metrics (JSONL, TensorBoard) and checkpoints."""
    resume: str = "auto"
    """``auto`` (the latest complete checkpoint in ``output_dir``, if any), ``disable``, or a checkpoint path."""
    seed: int = 0
    """Seed of the driver, the data order and the engines."""
    logger: List[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl"])
    """Metric backends: ``console``, ``jsonl``, ``tensorboard``, ``wandb``."""
    project_name: str = "rlplat"
    """Project name for wandb."""
    experiment_name: Optional[str] = None
    """Run name for wandb (default: the output directory's name)."""


@dataclasses.dataclass
class ClusterConfig:
    backend: str = "ray"
    """``ray`` (processes placed by Ray) or ``local`` (one process, world size 1, for debugging)."""
    address: Optional[str] = None
    """An existing Ray cluster to join (``auto`` or ``host:port``); None starts a local one."""
    nnodes: int = 1
    """Machines to use."""
    devices_per_node: int = 1
    """Worker processes per machine (GPUs per machine with ``use_gpu``)."""
    use_gpu: bool = False
    """Place workers on GPUs (NCCL) instead of CPUs (gloo)."""


@dataclasses.dataclass
class RLConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: Dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "grpo"})
    """``name`` of the registered algorithm plus its node (``adv_estimator``, ``gamma``, ``lam``,
    ``kl_ctrl``, ...); the algorithm's defaults fill what is not set."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)


def known_keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a structured node (for suggestions)."""
    keys = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            full = f"{prefix}{key}"
            keys.append(full)
            keys.extend(known_keys(node[key], f"{full}."))
    return keys


def suggest(key: str, candidates: Sequence[str]) -> str:
    match = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def merge_checked(base: DictConfig, extra: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, extra)
    except (ConfigKeyError, ConfigAttributeError) as error:
        key = getattr(error, "full_key", None) or str(error)
        raise ConfigError(f"{source}: unknown config key '{key}'.{suggest(str(key), known_keys(base))}") from None
    except ValidationError as error:
        raise ConfigError(f"{source}: {error.full_key} = {error.value!r} has the wrong type ({error.msg.splitlines()[0]}).") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{source}: {str(error).splitlines()[0]}") from None


def algorithm_defaults(name: str) -> dict[str, Any]:
    """The chosen algorithm's defaults laid out as config nodes."""
    from rlplat import registry
    from rlplat.registry import RegistryError

    try:
        spec = registry.get("algorithm", name)()
    except RegistryError as error:
        raise ConfigError(f"algorithm.name: {error}") from None
    defaults = dict(spec.default_config)
    nodes: dict[str, Any] = {"algorithm": {"name": name}}
    if "actor" in defaults:
        nodes["actor"] = {"loss": defaults.pop("actor")}
    if "critic" in defaults:
        nodes["critic"] = {"loss": defaults.pop("critic")}
    if "reward" in defaults:
        reward = dict(defaults.pop("reward"))
        nodes["reward"] = {"manager": reward.pop("manager", "naive"), "config": reward}
    nodes["algorithm"].update(defaults)
    return nodes


def load_config(
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    algo: str | None = None,
    engine: str | None = None,
    rollout: str | None = None,
    validate: bool = True,
) -> DictConfig:
    """The resolved, validated config (see the module docstring for the order of sources)."""
    config = OmegaConf.structured(RLConfig)
    file_node = None
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"--config: {path} does not exist or is not a file.")
        try:
            file_node = OmegaConf.load(path)
        except Exception as error:
            raise ConfigError(f"--config {path}: not valid YAML ({str(error).splitlines()[0]}).") from None
    try:
        override_node = OmegaConf.from_dotlist(list(overrides))
    except Exception as error:
        raise ConfigError(f"overrides: {error}; write them as key=value, e.g. actor.optim.lr=1e-6.") from None
    shortcuts = OmegaConf.create({})
    if algo:
        shortcuts.algorithm = {"name": algo}
    if engine:
        shortcuts.actor = {"engine": engine}
        shortcuts.critic = {"engine": engine}
    if rollout:
        shortcuts.rollout = {"name": rollout}
    name = OmegaConf.select(override_node, "algorithm.name") or algo
    if name is None and file_node is not None:
        name = OmegaConf.select(file_node, "algorithm.name")
    config = merge_checked(config, algorithm_defaults(name or "grpo"), f"algorithm {name or 'grpo'!r} defaults")
    if file_node is not None:
        config = merge_checked(config, file_node, f"--config {config_file}")
    config = merge_checked(config, shortcuts, "command line")
    config = merge_checked(config, override_node, "overrides")
    if validate:
        validate_config(config)
    return config


def validate_config(config: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first problem found (checks that need no worker)."""
    from rlplat import registry
    from rlplat.registry import RegistryError

    def check_entry(kind: str, name: str, key: str) -> Any:
        try:
            entry = registry.entry(kind, name)
        except RegistryError as error:
            raise ConfigError(f"{key}: {error}") from None
        if entry.status != "ok":
            raise ConfigError(f"{key}: {kind} {name!r} is {entry.status}.")
        return entry

    algorithm = registry.get("algorithm", config.algorithm.name)()
    check_entry("engine", config.actor.engine, "actor.engine")
    check_entry("rollout", config.rollout.name, "rollout.name")
    check_entry("reward_manager", config.reward.manager, "reward.manager")
    check_entry("advantage_estimator", config.algorithm.get("adv_estimator", algorithm.adv_estimator), "algorithm.adv_estimator")
    if config.reward.scorer is not None:
        check_entry("reward_scorer", config.reward.scorer, "reward.scorer")
    if config.reward.custom_function.path is not None and not Path(config.reward.custom_function.path).is_file():
        raise ConfigError(f"reward.custom_function.path: {config.reward.custom_function.path} does not exist.")

    schema = registry.entry("algorithm", config.algorithm.name).config_schema
    if isinstance(schema, str):
        from rlplat.registry import resolve_dotted_path

        schema = resolve_dotted_path(schema)
    if dataclasses.is_dataclass(schema):
        allowed = {field.name for field in dataclasses.fields(schema)} | {"name", "filter_groups"}
        for key in config.algorithm:
            if key not in allowed:
                hint = suggest(key, sorted(allowed)).replace(" Did you mean '", " Did you mean 'algorithm.")
                raise ConfigError(f"unknown config key 'algorithm.{key}'.{hint}")

    rollout_entry = registry.entry("rollout", config.rollout.name)
    if rollout_entry.metadata.get("needs_gpu") and not config.cluster.use_gpu:
        raise ConfigError(
            f"rollout {config.rollout.name!r} runs on GPUs only: set cluster.use_gpu=true "
            "(and cluster.devices_per_node to the GPUs per machine), or use the hf rollout on CPUs."
        )
    rollout_schema = rollout_entry.config_schema
    if isinstance(rollout_schema, str):
        from rlplat.registry import resolve_dotted_path

        rollout_schema = resolve_dotted_path(rollout_schema)
    if dataclasses.is_dataclass(rollout_schema):
        allowed = {field.name for field in dataclasses.fields(rollout_schema)}
        for key in config.rollout.config:
            if key not in allowed:
                hint = suggest(key, sorted(allowed)).replace(" Did you mean '", " Did you mean 'rollout.config.")
                raise ConfigError(f"unknown config key 'rollout.config.{key}' for rollout {config.rollout.name!r}.{hint}")

    critic_enabled = config.critic.enable
    if algorithm.needs_critic and critic_enabled is False:
        raise ConfigError(
            f"algorithm {algorithm.name!r} needs a critic, but critic.enable=false. Remove that override or "
            "choose an algorithm without a critic (e.g. grpo)."
        )
    if config.model.path is None:
        raise ConfigError("model.path is not set: give a local Hugging Face directory (model.path=/path/to/model).")
    if not Path(config.model.path).is_dir():
        raise ConfigError(f"model.path: {config.model.path} is not a directory (a local Hugging Face model folder is expected).")
    if not config.data.train_files:
        raise ConfigError("data.train_files is empty: give one or more parquet files (data.train_files=[a.parquet]).")
    for key in ("train_files", "val_files"):
        for path in config.data[key]:
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: {path} does not exist.")

    world = config.cluster.nnodes * config.cluster.devices_per_node if config.cluster.backend == "ray" else 1
    prompts, n = config.data.train_batch_size, config.rollout.n
    roles = ["actor"] + (["critic"] if algorithm.needs_critic or critic_enabled else [])
    for role in roles:
        mini = config[role].ppo_mini_batch_size
        if prompts % mini:
            raise ConfigError(
                f"data.train_batch_size={prompts} prompts do not split into {role}.ppo_mini_batch_size={mini}; "
                f"make train_batch_size a multiple of ppo_mini_batch_size."
            )
        if (mini * n) % world:
            raise ConfigError(
                f"{role}.ppo_mini_batch_size={mini} prompts x rollout.n={n} = {mini * n} responses do not split over "
                f"{world} worker processes (cluster.nnodes x cluster.devices_per_node); make them a multiple of {world}."
            )
    if (prompts * n) % world:
        raise ConfigError(f"data.train_batch_size x rollout.n = {prompts * n} responses do not split over {world} worker processes.")
    if config.cluster.backend not in ("ray", "local"):
        raise ConfigError(f"cluster.backend must be 'ray' or 'local', got {config.cluster.backend!r}.")
    if config.trainer.resume not in ("auto", "disable") and not Path(config.trainer.resume).exists():
        raise ConfigError(f"trainer.resume: {config.trainer.resume} is neither auto, disable nor an existing checkpoint.")


def to_yaml(config: DictConfig) -> str:
    return OmegaConf.to_yaml(config, resolve=True)
