"""The run's config: typed OmegaConf structured configs, a docstring per field, validated before any
worker starts.

``load_config(config_file, overrides, algo=..., engine=..., rollout=...)`` builds it in this order:
the defaults below, then the chosen algorithm's defaults (:meth:`Algorithm.default_nodes`: the
``algorithm`` node, and the ``actor.loss`` / ``critic.loss`` / ``reward`` settings it implies), then the
YAML file, then the dotted ``key=value`` overrides.

Core's nodes are typed here. The nodes plugins own (``actor.engine_config``, ``critic.engine_config``,
``rollout.config``, ``reward.config``, ``actor.loss`` and its ``policy_loss``, ``critic.loss``,
``algorithm``, ``roles.<name>``) are checked by :func:`validate_config` in one loop
(:func:`plugin_nodes`, in :mod:`rlplat.config.components` with the nodes each component receives)
against the schema each plugin declares, with the same reader the plugin uses in
its worker (:func:`rlplat.config_node.read_config_node`). A misspelled or mistyped key anywhere, an
unknown plugin, invalid sampling settings, a missing reward function, batch sizes that do not divide, an
algorithm that needs a critic without one, or a missing model or data path raises :class:`ConfigError`:
one paragraph saying what, where, and the closest valid choice, before any worker or run directory exists.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from rlplat.config_node import ConfigError, did_you_mean, read_config_node, resolve_schema
# the nodes each component receives and the plugin-owned nodes: their own module, the names stay importable here
from rlplat.config.components import (BUILTIN_LOSS_SCHEMAS, ENGINE_BUILD_SOURCES, ROLLOUT_BUILD_SOURCES,  # noqa: F401
                                      SAMPLING_SOURCES, PluginNode, engine_node, entry_schema, loss_schema, owned_nodes,
                                      optimizer_build, plugin_nodes, rollout_node, sampling_node, total_training_steps, uses_critic)
from rlplat.data_config import DataConfig
from rlplat.lora import LoraConfig, check_lora
from rlplat.config.moe import MoEConfig, check_moe
from rlplat.config.modes import check_trainer_mode
from rlplat.config.trainer import LOGGER_BACKENDS, SharedTrainerConfig, check_run_directory

__all__ = ["ConfigError", "RLConfig", "load_config", "validate_config", "plugin_nodes", "engine_node",
           "rollout_node", "sampling_node", "to_yaml"]


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
class EngineRoleConfig:
    """What the actor and the critic share: an engine, its optimizer, and how a step's batch is cut."""

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
    """The loss settings (``clip_ratio``, ``loss_agg_mode``, ``use_kl_loss``, ``kl_loss_coef``,
    ``entropy_coeff``, ``policy_loss.loss_mode``, ...; :class:`rlplat.losses.PolicyLossConfig` for the
    actor, ``ValueLossConfig`` for the critic); the algorithm's defaults fill what is not set."""
    engine_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's own keys (e.g. ``enable_gradient_checkpointing``), checked against the schema the
    engine registers; ``rlplat config explain actor.engine_config`` lists them."""


#: ``actor.recompute_old_log_prob`` values.
OLD_LOG_PROB_MODES = ("auto", "always", "never")


@dataclasses.dataclass
class ActorConfig(EngineRoleConfig):
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA adapters (:mod:`rlplat.lora`); rank 0: full fine-tuning."""
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    """Mixture-of-experts policies: ``router_replay`` (off, r2, r3) and the router's ``aux_loss_coef`` and
    ``z_loss_coef`` (:mod:`rlplat.config.moe`)."""
    recompute_old_log_prob: str = "auto"
    """Whether ``old_log_probs`` come from a forward pass of their own before the update: ``always``;
    ``never`` (the update's first forward supplies them: only for a strictly on-policy update, one
    ``ppo_epochs`` and one mini-batch per step, with nothing reading them before the update); ``auto``
    (the default) skips the pass on the steps where that holds and runs it otherwise (PPO epochs,
    several mini-batches, KL in the reward). The ``rollout/log_prob_diff_*`` metric is there in every mode."""
    old_log_probs: Optional[str] = None
    """Resolved when the run loads, not set by hand (a value given is replaced): where this run's ``old_log_probs``
    come from, decided once: ``pass`` (a forward pass of their own before the update), ``update`` (the update's
    first forward: a strictly on-policy update) or ``rollout`` (the rollout's log-probs:
    ``algorithm.rollout_correction.bypass_mode``). ``old_log_probs_reason`` says why."""
    old_log_probs_reason: Optional[str] = None
    """Why ``old_log_probs`` is what it is (resolved with it)."""


@dataclasses.dataclass
class CriticConfig(EngineRoleConfig):
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
    share_weights: bool = True
    """A colocated rollout reads the actor engine's parameters in place when both allow it (one process
    holding whole parameters, same device and dtype: ``cluster.backend=local`` or one worker): a weight
    sync then copies nothing and the model is held once. Elsewhere weights are copied bucket by bucket."""
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The rollout's own keys, checked against the schema the rollout registers."""
    driver: Optional[str] = None
    """Rollout driver (kind ``rollout_driver``) turning prompts into trajectories, e.g. ``agent_loops``
    (rlplat-agents). None: the driver whose trigger the run sets (``agent.loop``, or an ``agent_name``
    column in the data), else the rollout's batched ``generate``."""


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
    """Registered scorer (kind ``reward_scorer``). None: the custom function when one is given, else each
    row's ``data_source`` picks the scorer registered for it (``openai/gsm8k`` -> ``gsm8k``, the MATH sets
    -> ``math``) and other sources get ``exact_match`` (1 when the response equals the ground truth,
    stripped). Giving both a scorer and a custom function is an error."""
    custom_function: CustomFunctionConfig = dataclasses.field(default_factory=CustomFunctionConfig)
    """A scorer from a file instead of a registered one."""
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The reward manager's own settings (``fallback_score``, ``timeout_s``, overlong buffer, ...),
    checked against the schema the manager registers."""


@dataclasses.dataclass
class TrainerConfig(SharedTrainerConfig):
    """``rlplat run``'s ``trainer`` node: the keys shared with ``rlplat sft`` (:class:`SharedTrainerConfig`)
    and the RL loop's own."""

    test_freq: int = 0
    """Validate every this many steps (0: never during training)."""
    balance_batch: bool = True
    """Order each step's rows so that every data-parallel rank of the actor gets about the same number of
    tokens (verl's ``trainer.balance_batch``): with long-tail lengths the slowest rank sets each pass's time."""
    output_dir: str = "runs/rlplat"
    """Run directory: resolved config, metrics (JSONL, TensorBoard) and checkpoints."""
    seed: int = 0
    """Seed of the driver, the data order and the engines."""
    mode: str = "sync"
    """``sync`` (generate, then train on it), ``colocate_async`` (the rollout in the actor's processes
    generates the next batches ahead, while the driver scores and prepares this one) or
    ``separate_async`` (the rollout in a pool of its own generates while the actor trains; weights move
    through the object store). See :mod:`rlplat.trainer.pipeline` and :mod:`rlplat.config.modes`."""
    max_staleness: int = 1
    """Asynchronous modes: the most policy versions (updates) a trained sample may lag behind the weights
    it trains."""
    staleness_policy: str = "wait"
    """Asynchronous modes: ``wait`` (the rollout never starts a generation that would be trained beyond
    ``max_staleness``) or ``drop`` (it runs ``rollout_ahead`` batches ahead; samples beyond the bound are
    dropped and their prompts generated again from the current weights)."""
    rollout_ahead: Optional[int] = None
    """Asynchronous modes: generations kept in flight ahead of the trainer; None: ``max_staleness + 1``."""
    rollout_dispatch: str = "split"
    """``separate_async``: ``split`` (each generation split over the rollout's processes) or ``replica``
    (each generation whole on one process, step ``s`` on process ``s % processes``: the processes generate
    different steps at once, so one batch's slow tail overlaps the next batch's generation)."""
    partial_rollout: str = "off"
    """``separate_async``: what a weight update does to the generations in flight. ``off``: it waits for the
    generations started before it (each generation samples from one policy version). ``keep`` or
    ``recompute``: it lands at the next token boundary and the generations go on with the new weights,
    keeping their KV cache (``keep``) or rebuilding it from each prefix (``recompute``); every token
    records the version that sampled it, and each rollout process serves several generations at once
    (continuous batching across steps). The rollout must list the mode in its ``partial_rollout_modes``.
    See :mod:`rlplat.trainer.pipeline`."""
    rollout_dump_dir: Optional[str] = None
    """Write each step's generated and scored batch to ``<dir>/step_<N>.parquet`` (:mod:`rlplat.trainer.rollout_dump`)."""
    replay_rollouts: Optional[str] = None
    """Train on the batches a run dumped to this directory instead of generating them (``trainer.mode=sync``)."""


@dataclasses.dataclass
class ClusterConfig:
    backend: str = "ray"
    """``ray`` (processes placed by Ray) or ``local`` (one process, world size 1, for debugging)."""
    address: Optional[str] = None
    """An existing Ray cluster to join (``auto`` or ``host:port``); None starts a local one."""
    nnodes: int = 1
    """Machines to use."""
    devices_per_node: int = 1
    """Worker processes per machine (GPUs per machine with ``use_gpu``). Above 1 needs ``backend=ray``."""
    use_gpu: Union[bool, str] = "auto"
    """Place workers on GPUs (NCCL) instead of CPUs (gloo). ``auto``: on GPUs when this process sees a CUDA
    device, else on CPUs; the resolved config records which. ``true`` without a visible CUDA device is
    refused before anything starts (unless joining a cluster at ``address``, whose GPUs are elsewhere)."""
    threads_per_process: Optional[int] = None
    """torch threads of each worker process. None: on Ray, each process's share of its machine's cores
    (cores // worker processes of its pool there, at least 1); with the local backend, torch's default
    (every core) for the one process."""
    cpus_per_process: float = 1.0
    """Ray CPUs each worker process reserves (below 1 to run more processes than a machine has cores,
    e.g. a rollout pool beside the actor's on a small CPU machine)."""
    py_modules: List[str] = dataclasses.field(default_factory=list)
    """Your own modules to ship to every Ray worker (a loss, a worker class or a reward defined in a
    module that is not installed): import names (``my_losses``, ``my_package``; a dotted name ships its
    top-level package) or local paths (a package folder or a ``.py`` file). Checked at load."""
    ship_driver_modules: bool = True
    """Also ship the driver's own code: the modules it imported from the ``__main__`` script's folder
    that no installed distribution provides (never site-packages; a package over 20 MiB is left out
    with a warning). See ``rlplat.start_ray``."""
    device_memory_gib: Optional[float] = None
    """Memory of one device in GiB, for the memory plan's check (``rlplat plan``; ``rlplat run`` refuses a
    run whose predicted peak exceeds it). None: CUDA's total memory of the driver's GPU with ``use_gpu``,
    else unknown (on CPU: not checked)."""
    memory_check: str = "refuse"
    """What ``rlplat run`` does when the memory plan does not fit: ``refuse`` (exit 2 before anything
    starts), ``warn`` (print why and run), ``skip`` (do not make the plan)."""
    runtime_env: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """More of Ray's runtime environment for every worker process: ``env_vars``, ``pip``,
    ``working_dir``, ``excludes``, ... (Ray's names; checked at load). Fixed when Ray starts: a run
    that joins Ray already started in its process cannot add to it."""


def resolve_use_gpu(config: DictConfig) -> None:
    """``cluster.use_gpu=auto`` becomes true when this process sees a CUDA device, else false (in place,
    so that the resolved config says which); any other value than auto, true or false is refused."""
    use_gpu = config.cluster.use_gpu
    if isinstance(use_gpu, bool):
        return
    if use_gpu != "auto":
        raise ConfigError(f"cluster.use_gpu must be auto, true or false, got {use_gpu!r}.")
    from rlplat.cuda_devices import visible_cuda_devices

    config.cluster.use_gpu = visible_cuda_devices() > 0


def check_cluster(config: DictConfig) -> None:
    """The ``cluster`` node's values agree with one another (any machine; ``rlplat run`` and ``rlplat sft``)."""
    resolve_use_gpu(config)
    cluster = config.cluster
    if cluster.backend not in ("ray", "local"):
        raise ConfigError(f"cluster.backend must be 'ray' or 'local', got {cluster.backend!r}.")
    for key in ("nnodes", "devices_per_node"):
        if cluster[key] < 1:
            raise ConfigError(f"cluster.{key} must be >= 1, got {cluster[key]}.")
    if cluster.backend == "local" and (cluster.nnodes > 1 or cluster.devices_per_node > 1):
        asked = cluster.nnodes * cluster.devices_per_node
        raise ConfigError(f"cluster.backend=local runs one worker process, but cluster.nnodes={cluster.nnodes} x "
                          f"cluster.devices_per_node={cluster.devices_per_node} asks for {asked}: use cluster.backend=ray "
                          f"for {asked} processes, or set cluster.devices_per_node=1 (and cluster.nnodes=1).")


def check_machine(config: DictConfig) -> None:
    """What the run asks of this machine (``rlplat run``, ``rlplat sft`` and the trainers, before Ray or
    any worker starts; not ``rlplat plan``, which may plan for another machine): ``cluster.use_gpu=true``
    needs a CUDA device visible here, unless the run joins a cluster at ``cluster.address``."""
    cluster = config.cluster
    if cluster.use_gpu is True and cluster.address is None:
        from rlplat.cuda_devices import cuda_devices_description, visible_cuda_devices

        if visible_cuda_devices() == 0:
            raise ConfigError(f"cluster.use_gpu=true, but this process sees no CUDA device ({cuda_devices_description()}): "
                              "leave cluster.use_gpu=auto (GPUs when visible, CPU processes otherwise) or set "
                              "cluster.use_gpu=false to run the workers as CPU processes.")


def check_before_start(config: DictConfig) -> None:
    """What a command that trains checks after validation, before Ray or any worker starts: this machine
    (:func:`check_machine`) and the run directory (:func:`rlplat.config.trainer.check_run_directory`)."""
    check_machine(config)
    check_run_directory(config.trainer)


@dataclasses.dataclass
class RLConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: Dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "grpo"})
    """``name`` of the registered algorithm plus its node (``adv_estimator``, ``gamma``, ``lam``,
    ``kl_ctrl``, ...; :class:`rlplat.contracts.algorithm.AlgorithmConfig` or the algorithm's schema);
    the algorithm's defaults fill what is not set."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    roles: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Placement of worker roles (kind ``role``): ``roles.critic.placement=separate``,
    ``roles.rollout.placement=separate roles.rollout.devices_per_node=2``, and a plugin role's own keys
    (:class:`rlplat.contracts.role.RoleConfig` or the role's schema)."""


def known_keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a structured node (for suggestions)."""
    keys = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            full = f"{prefix}{key}"
            keys.append(full)
            keys.extend(known_keys(node[key], f"{full}."))
    return keys


def merge_checked(base: DictConfig, extra: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, extra)
    except (ConfigKeyError, ConfigAttributeError) as error:
        key = getattr(error, "full_key", None) or str(error)
        raise ConfigError(f"{source}: unknown config key '{key}'.{did_you_mean(str(key), known_keys(base))}") from None
    except ValidationError as error:
        raise ConfigError(f"{source}: {error.full_key} = {error.value!r} has the wrong type ({error.msg.splitlines()[0]}).") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{source}: {str(error).splitlines()[0]}") from None


def algorithm_schema(name: str) -> type:
    """The dataclass the ``algorithm`` node of algorithm ``name`` is read with: its entry's ``config_schema``
    with :class:`rlplat.contracts.algorithm.AlgorithmConfig`'s keys (the loop's), or AlgorithmConfig alone
    (:func:`rlplat.contracts.algorithm.algorithm_node_schema`)."""
    from rlplat import registry
    from rlplat.contracts.algorithm import algorithm_node_schema

    return algorithm_node_schema(resolve_schema(registry.entry("algorithm", name).config_schema))


def algorithm_spec(name: str) -> Any:
    """The registered algorithm's spec; a :class:`ConfigError` naming what is available otherwise."""
    from rlplat import registry
    from rlplat.registry import RegistryError

    try:
        return registry.get("algorithm", name)()
    except RegistryError as error:
        raise ConfigError(f"algorithm.name: {error}") from None


def read_sources(config_file: str | Path | None, overrides: Sequence[str],
                 example: str = "actor.optim.lr=1e-6") -> tuple[DictConfig | None, DictConfig]:
    """The ``--config`` file's node (None without a file) and the dotted overrides' node, read as every
    command that takes a run's arguments reads them (``rlplat run``, ``rlplat sft``); :class:`ConfigError`
    for a missing file, a file that is not YAML or an override that is not ``key=value`` (``example`` shows
    one)."""
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
        raise ConfigError(f"overrides: {error}; write them as key=value, e.g. {example}.") from None
    return file_node, override_node


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
    config = base_config()
    file_node, override_node = read_sources(config_file, overrides)
    from rlplat.deprecation import rename_config_keys  # renamed keys are read under their new names, with a warning

    file_node = rename_config_keys(file_node, f"--config {config_file}")
    override_node = rename_config_keys(override_node, "overrides")
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
    name = name or "grpo"
    defaults = algorithm_spec(name).default_nodes()
    chosen_loss = OmegaConf.select(override_node, "actor.loss.policy_loss.loss_mode")
    if chosen_loss is None and file_node is not None:
        chosen_loss = OmegaConf.select(file_node, "actor.loss.policy_loss.loss_mode")
    if chosen_loss is not None and chosen_loss != defaults["actor"]["loss"]["policy_loss"]["loss_mode"]:
        # the algorithm's knobs belong to its own policy loss, not to the one the user chose instead
        defaults["actor"]["loss"]["policy_loss"] = {"loss_mode": chosen_loss}
    config = merge_checked(config, defaults, f"algorithm {name!r} defaults")
    if file_node is not None:
        config = merge_checked(config, file_node, f"--config {config_file}")
    config = merge_checked(config, shortcuts, "command line")
    config = merge_checked(config, override_node, "overrides")
    resolve_use_gpu(config)
    if config.trainer.mode == "separate_async" and "placement" not in ((config.get("roles") or {}).get("rollout") or {}):
        OmegaConf.update(config, "roles.rollout.placement", "separate", force_add=True)  # the mode's pool
    if validate:
        validate_config(config)
        resolve_old_log_probs(config, algorithm_spec(config.algorithm.name))
    return config


def base_config() -> DictConfig:
    """Core's typed defaults (:class:`RLConfig`) with every node a plugin owns (kind ``config_node``) in its
    place, typed by the node's schema."""
    from omegaconf import open_dict

    from rlplat import registry

    config = OmegaConf.structured(RLConfig)
    for entry in sorted(registry.entries("config_node"), key=lambda entry: entry.name):
        schema = resolve_schema(entry.config_schema)
        if schema is None:
            raise ConfigError(f"config node {entry.name!r} from {entry.origin} declares no config_schema.")
        if OmegaConf.select(config, entry.name, default=None) is not None:
            raise ConfigError(f"config node {entry.name!r} from {entry.origin} is a node core already has.")
        with open_dict(config):
            OmegaConf.update(config, entry.name, OmegaConf.structured(schema), force_add=True, merge=False)
    return config


def data_columns(files: Sequence[str]) -> set[str]:
    """The column names of the parquet files (from their schemas; no data is read)."""
    import pyarrow.parquet as pq

    return {name for path in files for name in pq.read_schema(path).names}


def rollout_driver(config: DictConfig, data: DataConfig | None = None) -> str | None:
    """The run's rollout driver (kind ``rollout_driver``): ``rollout.driver``, else the first driver (by
    name) whose ``metadata["config_key"]`` the run sets or whose ``metadata["column"]`` the data has, else
    None (the rollout's batched ``generate``)."""
    from rlplat import registry

    if config.rollout.driver is not None:
        entry_schema("rollout_driver", config.rollout.driver, "rollout.driver")
        return config.rollout.driver
    data = data if data is not None else read_config_node(config.data, DataConfig, "data")
    columns = data_columns([*data.train_files, *data.val_files])
    for entry in sorted(registry.entries("rollout_driver"), key=lambda entry: entry.name):
        key, column = entry.metadata.get("config_key"), entry.metadata.get("column")
        if (key and OmegaConf.select(config, key, default=None) is not None) or (column and column in columns):
            return entry.name
    if "agent_name" in columns:
        raise ConfigError("the data has an agent_name column (rows naming their agent loops), but no installed rollout "
                          "driver reads it: install rlplat-agents (pip install rlplat-agents), or drop the column.")
    return None


def check_config_nodes(config: DictConfig) -> None:
    """Each plugin-owned node's check (the factory of its ``config_node`` entry), once the config is checked."""
    from rlplat import registry

    for entry in sorted(registry.entries("config_node"), key=lambda entry: entry.name):
        node = read_config_node(OmegaConf.select(config, entry.name, default=None), resolve_schema(entry.config_schema),
                                entry.name)
        try:
            check = entry.load()
        except Exception as error:
            raise ConfigError(f"{entry.name}: its check could not be loaded: {error}") from None
        check(node, config)


# -- validation -------------------------------------------------------------------------------------------

def validate_config(config: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first problem found (checks that need no worker)."""
    from rlplat import registry

    algorithm = algorithm_spec(config.algorithm.name)
    check_cluster(config)  # first: cluster.use_gpu=auto resolved before the checks below read it
    for kind, key in (("engine", "actor.engine"), ("engine", "critic.engine"), ("rollout", "rollout.name"),
                      ("reward_manager", "reward.manager"), ("advantage_estimator", "algorithm.adv_estimator")):
        entry_schema(kind, OmegaConf.select(config, key), key)
    if config.reward.scorer is not None:
        entry_schema("reward_scorer", config.reward.scorer, "reward.scorer")
    if config.model.path is None:
        raise ConfigError("model.path is not set: give a local Hugging Face directory (model.path=/path/to/model).")
    if not Path(config.model.path).is_dir():
        raise ConfigError(f"model.path: {config.model.path} is not a directory (a local Hugging Face model folder is expected).")
    data = read_config_node(config.data, DataConfig, "data")
    if not data.train_files:
        raise ConfigError("data.train_files is empty: give one or more parquet files (data.train_files=[a.parquet]).")
    for key in ("train_files", "val_files"):
        for path in getattr(data, key):
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: {path} does not exist.")

    check_sampling(config)
    check_trainer_mode(config)
    check_lora(config)
    check_moe(config)
    if config.trainer.replay_rollouts is not None and config.trainer.mode != "sync":
        raise ConfigError(f"trainer.replay_rollouts trains on dumped batches in place of generation; trainer.mode="
                          f"{config.trainer.mode} generates ahead: use trainer.mode=sync")
    for node in plugin_nodes(config, algorithm, total_training_steps(config, parquet_rows(data.train_files))):
        node.check()
    check_rollout_correction(config)
    check_scorer(config)
    check_roles(config, algorithm, registry, total_training_steps(config, parquet_rows(data.train_files)))
    rollout_driver(config, data)
    check_config_nodes(config)

    rollout_entry = registry.entry("rollout", config.rollout.name)
    if rollout_entry.needs_gpu and not config.cluster.use_gpu:
        raise ConfigError(
            f"rollout {config.rollout.name!r} runs on GPUs only: set cluster.use_gpu=true "
            "(and cluster.devices_per_node to the GPUs per machine), or use the hf rollout on CPUs."
        )
    if algorithm.needs_critic and config.critic.enable is False:
        raise ConfigError(
            f"algorithm {algorithm.name!r} needs a critic, but critic.enable=false. Remove that override or "
            "choose an algorithm without a critic (e.g. grpo)."
        )
    if config.cluster.memory_check not in ("refuse", "warn", "skip"):
        raise ConfigError(f"cluster.memory_check must be refuse, warn or skip, got {config.cluster.memory_check!r}.")
    if config.cluster.device_memory_gib is not None and not config.cluster.device_memory_gib > 0:
        raise ConfigError(f"cluster.device_memory_gib must be > 0 or null, got {config.cluster.device_memory_gib}.")
    if not config.cluster.cpus_per_process > 0:
        raise ConfigError(f"cluster.cpus_per_process must be > 0, got {config.cluster.cpus_per_process}.")
    if config.cluster.threads_per_process is not None and config.cluster.threads_per_process < 1:
        raise ConfigError(f"cluster.threads_per_process must be >= 1 or null (each process's share of its "
                          f"machine's cores), got {config.cluster.threads_per_process}.")
    check_code_shipping(config.cluster)
    check_batch_sizes(config, ["actor"] + (["critic"] if uses_critic(config, algorithm) else []))
    check_old_log_prob_mode(config, algorithm)
    for name in config.trainer.logger:
        if name not in LOGGER_BACKENDS:
            raise ConfigError(f"trainer.logger: unknown logging backend {name!r}; the backends are {', '.join(LOGGER_BACKENDS)}."
                              f"{did_you_mean(name, LOGGER_BACKENDS)}")
    if config.trainer.resume not in ("auto", "disable") and not Path(config.trainer.resume).exists():
        raise ConfigError(f"trainer.resume: {config.trainer.resume} is neither auto, disable nor an existing checkpoint.")


def old_log_prob_pass_reasons(config: DictConfig, algorithm: Any) -> list[str]:
    """Why the steps of this run need ``old_log_probs`` before the update (a forward pass of their own);
    empty when the update's first forward can supply them (see ``actor.recompute_old_log_prob``)."""
    actor, reasons = config.actor, []
    if actor.ppo_epochs != 1:
        reasons.append(f"actor.ppo_epochs={actor.ppo_epochs}: the epochs after the first see updated weights")
    if actor.ppo_mini_batch_size < config.data.train_batch_size:
        reasons.append(f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} < data.train_batch_size="
                       f"{config.data.train_batch_size}: the mini-batches after the first see updated weights")
    if OmegaConf.select(config, "algorithm.use_kl_in_reward", default=False):
        reasons.append("algorithm.use_kl_in_reward=true: the reward's KL term reads them before the update")
    correction_node = OmegaConf.select(config, "algorithm.rollout_correction", default=None)
    if correction_node is not None:
        from rlplat.losses.rollout_correction import read_rollout_correction

        correction = read_rollout_correction(OmegaConf.to_container(correction_node, resolve=True))
        if not correction.bypass_mode and (correction.rollout_is is not None or correction.rollout_rs is not None):
            reasons.append("algorithm.rollout_correction weights or rejects tokens by old_log_probs before the update")
    if getattr(algorithm, "reads_old_log_probs", False):
        reasons.append(f"algorithm {algorithm.name!r} reads them before the update (Algorithm.reads_old_log_probs)")
    return reasons


#: Where ``old_log_probs`` come from (``actor.old_log_probs``).
OLD_LOG_PROB_SOURCES = ("pass", "update", "rollout")


def old_log_prob_source(config: DictConfig, algorithm: Any) -> tuple[str, str]:
    """``(source, reason)``: where this run's ``old_log_probs`` come from (:data:`OLD_LOG_PROB_SOURCES`), decided
    once from ``algorithm.rollout_correction``, ``actor.recompute_old_log_prob`` and the update's shape."""
    from rlplat.losses.rollout_correction import read_rollout_correction

    node = OmegaConf.select(config, "algorithm.rollout_correction", default=None)
    correction = read_rollout_correction(OmegaConf.to_container(node, resolve=True)) if node is not None else None
    if correction is not None and correction.bypass_mode:
        return "rollout", ("algorithm.rollout_correction.bypass_mode=true: the rollout's policy is the old one (the "
                           "ratio is pi_theta / pi_rollout)")
    if config.actor.recompute_old_log_prob == "always":
        return "pass", "actor.recompute_old_log_prob=always"
    reasons = old_log_prob_pass_reasons(config, algorithm)
    if reasons:
        return "pass", "; ".join(reasons)
    return "update", ("the update is strictly on-policy (one epoch of one mini-batch, nothing reads them before it): "
                      "its first forward gives them (a step whose batch an algorithm grew past one mini-batch runs the "
                      "pass, unless actor.recompute_old_log_prob=never)")


def resolve_old_log_probs(config: DictConfig, algorithm: Any) -> tuple[str, str]:
    """Write :func:`old_log_prob_source` into ``actor.old_log_probs`` and ``actor.old_log_probs_reason``."""
    source, reason = old_log_prob_source(config, algorithm)
    config.actor.old_log_probs, config.actor.old_log_probs_reason = source, reason
    return source, reason


def check_old_log_prob_mode(config: DictConfig, algorithm: Any) -> None:
    mode = config.actor.recompute_old_log_prob
    if mode not in OLD_LOG_PROB_MODES:
        raise ConfigError(f"actor.recompute_old_log_prob must be one of {', '.join(OLD_LOG_PROB_MODES)}, got {mode!r}."
                          f"{did_you_mean(str(mode), OLD_LOG_PROB_MODES)}")
    reasons = old_log_prob_pass_reasons(config, algorithm)
    if mode == "never" and reasons:
        raise ConfigError(
            "actor.recompute_old_log_prob=never takes old_log_probs from the update's first forward, which is "
            f"only right for a strictly on-policy update; this run is not: {'; '.join(reasons)}. "
            "Use auto (the default: the pass runs where it is needed) or always."
        )


def check_rollout_correction(config: DictConfig) -> None:
    """``algorithm.rollout_correction`` is a node the loss kit can read (verl's keys and presets), and an
    asynchronous run whose samples may be stale corrects for it (or says it does not want to)."""
    from rlplat.losses.rollout_correction import read_rollout_correction

    node = OmegaConf.select(config, "algorithm.rollout_correction", default=None)
    correction = read_rollout_correction(OmegaConf.to_container(node, resolve=True)) if node is not None else None
    mode, staleness = config.trainer.mode, config.trainer.max_staleness
    if mode != "sync" and staleness > 0 and not (correction is not None and (correction.enabled or correction.allow_uncorrected)):
        raise ConfigError(
            f"trainer.mode={mode} with trainer.max_staleness={staleness} trains on samples from up to {staleness} older "
            "policy versions, and without algorithm.rollout_correction the loss's ratio is taken against the current "
            "weights as if they had sampled them. Correct it (algorithm.rollout_correction.preset=decoupled_token_is, "
            "or bypass_ppo_clip; `rlplat config explain algorithm.rollout_correction`), set trainer.max_staleness=0, or "
            "train uncorrected on purpose with algorithm.rollout_correction.allow_uncorrected=true")


def check_code_shipping(cluster: DictConfig) -> None:
    """``cluster.py_modules`` can be found and ``cluster.runtime_env`` is one Ray accepts (this
    imports Ray, so only when either is set)."""
    if not cluster.py_modules and not cluster.runtime_env:
        return
    from rlplat.controller.ray_backend import worker_runtime_env

    try:
        worker_runtime_env(list(cluster.py_modules), OmegaConf.to_container(cluster.runtime_env))
    except ValueError as error:
        raise ConfigError(f"cluster.{error}") from None


def parquet_rows(files: Sequence[str]) -> int:
    """Rows of the parquet files, read from their metadata (no data is loaded)."""
    import pyarrow.parquet as pq

    rows = 0
    for path in files:
        try:
            rows += pq.ParquetFile(path).metadata.num_rows
        except Exception as error:
            raise ConfigError(f"data.train_files: {path} is not a readable parquet file ({error}).") from None
    return rows


def check_sampling(config: DictConfig) -> None:
    from rlplat.contracts.rollout import SamplingParams

    try:
        SamplingParams(**sampling_node(config))
    except ValueError as error:
        problems = str(error).split(": ", 1)[-1].split("; ")
        named = [next((problem.replace(field, key, 1) for field, key in SAMPLING_SOURCES.items()
                       if problem.startswith(f"{field} ")), problem) for problem in problems]
        raise ConfigError(f"invalid sampling settings: {'; '.join(named)}.") from None


def check_scorer(config: DictConfig) -> None:
    """The reward node selects exactly one scorer, and a custom function exists in its file."""
    from rlplat.scorers import scorer_for

    reward = config.reward
    try:
        scorer_for(reward.scorer, reward.custom_function.path, reward.custom_function.name)
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(f"{error}".rstrip(".") + ".") from None


def check_roles(config: DictConfig, algorithm: Any, registry: Any, total_steps: int) -> None:
    """The ``roles`` node, and each role's own check of the run config: the function its entry names in
    ``metadata["check"]`` (light: the role's class, and its worker's torch, are not imported)."""
    from rlplat.contracts.role import RunContext, read_role_config
    from rlplat.registry import resolve_dotted_path

    run = RunContext(config, algorithm, total_steps)
    for entry in registry.entries("role"):
        check = entry.metadata.get("check")
        if check is not None:
            (resolve_dotted_path(check) if isinstance(check, str) else check)(run)
    for name in config.roles:
        role = registry.get("role", name)()
        settings = read_role_config(config, name)
        if not role.movable and settings.placement != role.default_placement:
            raise ConfigError(f"roles.{name}.placement: the {name} role always runs {role.default_placement}.")
        if settings.placement == "separate" and config.cluster.backend == "local":
            raise ConfigError(f"roles.{name}.placement=separate needs cluster.backend=ray (the local backend is one process).")


def processes_of(config: DictConfig, role: str) -> tuple[int, str]:
    """Worker processes of ``role`` and the keys that set them: the cluster's, or its own pool's when
    ``roles.<role>.placement=separate``."""
    cluster = config.cluster
    if cluster.backend != "ray":
        return 1, "cluster.backend=local"
    node = config.roles.get(role) or {}
    if node.get("placement") == "separate":
        processes = (node.get("nnodes") or cluster.nnodes) * (node.get("devices_per_node") or cluster.devices_per_node)
        return processes, f"roles.{role}.nnodes x roles.{role}.devices_per_node"
    return cluster.nnodes * cluster.devices_per_node, "cluster.nnodes x cluster.devices_per_node"


def check_batch_sizes(config: DictConfig, roles: list[str]) -> None:
    prompts, n = config.data.train_batch_size, config.rollout.n
    for role in roles:
        world, source = processes_of(config, role)
        mini = config[role].ppo_mini_batch_size
        if prompts % mini:
            raise ConfigError(
                f"data.train_batch_size={prompts} prompts do not split into {role}.ppo_mini_batch_size={mini}; "
                f"make train_batch_size a multiple of ppo_mini_batch_size."
            )
        if (mini * n) % world:
            raise ConfigError(
                f"{role}.ppo_mini_batch_size={mini} prompts x rollout.n={n} = {mini * n} responses do not split over the "
                f"{world} worker processes of the {role} ({source}); make them a multiple of {world}."
            )
        if (prompts * n) % world:
            raise ConfigError(f"data.train_batch_size x rollout.n = {prompts * n} responses do not split over the "
                              f"{world} worker processes of the {role}.")


def to_yaml(config: DictConfig) -> str:
    return OmegaConf.to_yaml(config, resolve=True)
