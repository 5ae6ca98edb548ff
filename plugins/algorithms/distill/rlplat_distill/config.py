"""The ``distillation`` node: the teachers of an on-policy distillation run, which rows each scores, and
what it returns. Torch-free: the config loader checks it cheaply.

A run distils when ``distillation.teachers`` names at least one teacher and the actor loss has a
distillation term (``actor.loss.terms``, or ``actor.loss.policy_loss.loss_mode`` for pure distillation):
``reverse_kl`` reads the teacher's log-prob of each sampled token; ``reverse_kl_topk``, ``forward_kl_topk``
and ``jsd_topk`` read its ``top_k`` most likely tokens at each position (``distillation.top_k``; the
vocabulary size gives the full distribution). Each row goes to the teacher whose ``data_sources`` hold its
``teacher_key`` value (``data_source``), else to the teacher without ``data_sources`` (the default).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional

#: The policy losses (rlplat.losses.distillation) that read a teacher's columns, and those among them
#: that read its top-k.
DISTILLATION_LOSSES = ("reverse_kl", "reverse_kl_topk", "forward_kl_topk", "jsd_topk")
TOPK_LOSSES = ("reverse_kl_topk", "forward_kl_topk", "jsd_topk")
UNROUTED = ("error", "skip")
RETOKENIZE = ("never", "text")
SCORERS = ("engine", "rollout")


@dataclasses.dataclass
class TeacherConfig:
    """``distillation.teachers.<name>``: one teacher model and the rows it scores."""

    model_path: Optional[str] = None
    """Local Hugging Face directory of the teacher (a causal LM). Required."""
    tokenizer_path: Optional[str] = None
    """Its tokenizer's directory (None: ``model_path``); it must be the policy's (same vocabulary and special tokens)."""
    data_sources: Optional[List[str]] = None
    """The ``teacher_key`` values (data sources) whose rows this teacher scores; None: every row no other teacher
    claims (the default teacher; at most one)."""
    scorer: str = "engine"
    """What serves the teacher: ``engine``, a training engine's forward pass, or ``rollout``, a rollout that scores
    given tokens (``RolloutEngine.scores_tokens``: hf)."""
    engine: Optional[str] = None
    """``scorer=engine``: the registered training engine (kind ``engine``; None: ``actor.engine``)."""
    engine_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """``scorer=engine``: the engine's own keys for the teacher (e.g. ``dtype``), over the actor's ``engine_config``."""
    rollout: Optional[str] = None
    """``scorer=rollout``: the registered rollout (kind ``rollout``; None: ``rollout.name``). It keeps its weights
    between calls (a rollout asleep would need a weight sync the teacher never gets)."""
    rollout_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """``scorer=rollout``: the rollout's own keys for the teacher, over the run's ``rollout.config``."""
    micro_batch_size_per_gpu: Optional[int] = None
    """Rows per forward micro-batch (None: ``actor.micro_batch_size_per_gpu``)."""
    retokenize: str = "never"
    """``never``: the teacher scores the policy's token ids, so its tokenizer must be the policy's (checked at
    load). ``text`` (scoring the decoded text with the teacher's tokenizer and aligning the tokens) is not
    built: a teacher with another tokenizer is refused."""

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")
        if self.retokenize not in RETOKENIZE:
            raise ValueError(f"retokenize must be one of {', '.join(RETOKENIZE)}, got {self.retokenize!r}")
        if self.micro_batch_size_per_gpu is not None and self.micro_batch_size_per_gpu < 1:
            raise ValueError(f"micro_batch_size_per_gpu must be >= 1 or null, got {self.micro_batch_size_per_gpu}")
        if self.data_sources is not None and not self.data_sources:
            raise ValueError("data_sources is an empty list: name the sources this teacher scores, or null for the default teacher")


@dataclasses.dataclass
class DistillationConfig:
    """The ``distillation`` node: the teachers and how rows reach them. The losses are ``actor.loss.terms``."""

    teachers: Dict[str, TeacherConfig] = dataclasses.field(default_factory=dict)
    """The teachers by name (used in metrics: ``distill/<name>/...``); empty: no distillation."""
    teacher_key: str = "data_source"
    """The row field (a column of the data) whose value routes a row to a teacher."""
    top_k: int = 0
    """How many of the teacher's most likely tokens it returns per position, for the top-k losses (the
    vocabulary size: the whole distribution); 0 when only ``reverse_kl`` (sampled tokens) is used."""
    unrouted: str = "error"
    """A row whose ``teacher_key`` no teacher serves, without a default teacher: ``error`` stops the step
    naming the value; ``skip`` leaves the row out of the distillation terms (the RL term still trains on it)."""
    sleep: bool = True
    """Colocated teachers: move their parameters off the accelerator between scoring calls (nothing to move on CPU)."""

    def __post_init__(self) -> None:
        problems = []
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if self.unrouted not in UNROUTED:
            problems.append(f"unrouted must be one of {', '.join(UNROUTED)}, got {self.unrouted!r}")
        defaults = [name for name, teacher in self.teachers.items() if teacher.data_sources is None]
        if len(defaults) > 1:
            problems.append(f"teachers {', '.join(defaults)} have no data_sources: at most one teacher is the default")
        claimed: dict[str, str] = {}
        for name, teacher in self.teachers.items():
            for source in teacher.data_sources or []:
                if source in claimed:
                    problems.append(f"data source {source!r} is claimed by teachers {claimed[source]} and {name}: one teacher per source")
                claimed[source] = name
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def enabled(self) -> bool:
        return bool(self.teachers)


def read_distillation(config: Any) -> DistillationConfig:
    """The ``distillation`` node of a run config, typed and checked."""
    from omegaconf import OmegaConf

    from rlplat.config_node import read_config_node

    node = OmegaConf.select(config, "distillation", default=None)
    return read_config_node(node, DistillationConfig, "distillation")


def loss_modes(config: Any) -> list[str]:
    """The policy losses the actor loss uses: its ``policy_loss`` (when its coefficient is not 0) and its terms."""
    from omegaconf import OmegaConf

    loss = OmegaConf.to_container(OmegaConf.select(config, "actor.loss"), resolve=True) or {}
    modes = [str(term.get("loss_mode")) for term in loss.get("terms") or [] if isinstance(term, dict)]
    if loss.get("policy_loss_coef", 1.0) != 0:
        modes.insert(0, str((loss.get("policy_loss") or {}).get("loss_mode", "")))
    return modes


def engine_node(config: Any, teacher: TeacherConfig, total_steps: int) -> dict[str, Any]:
    """What a teacher's engine factory receives: the actor's engine node with the teacher's model, no LoRA and
    no reward or value head, then the teacher's ``engine_config``."""
    from omegaconf import OmegaConf

    from rlplat.config.components import engine_node as actor_engine_node

    node = actor_engine_node(config, "actor", total_steps)
    node.update({"model_path": str(Path(teacher.model_path).resolve()), "lora": None, "value_model": False,
                 "reward_model": False})
    if teacher.micro_batch_size_per_gpu is not None:
        node["micro_batch_size_per_gpu"] = teacher.micro_batch_size_per_gpu
    own = teacher.engine_config
    if not isinstance(own, dict):
        own = OmegaConf.to_container(own, resolve=True)
    return {**node, **own}


def teacher_engine(config: Any, teacher: TeacherConfig) -> str:
    return teacher.engine or str(config.actor.engine)


def teacher_rollout(config: Any, teacher: TeacherConfig) -> str:
    return teacher.rollout or str(config.rollout.name)


def rollout_node(config: Any, teacher: TeacherConfig) -> dict[str, Any]:
    """What a rollout teacher's factory receives: the run's rollout node with the teacher's model, its weights
    loaded from there, then the teacher's ``rollout_config``."""
    from omegaconf import OmegaConf

    from rlplat.config.components import rollout_node as run_rollout_node

    own = teacher.rollout_config
    if not isinstance(own, dict):
        own = OmegaConf.to_container(own, resolve=True)
    run_node = run_rollout_node(config) if teacher_rollout(config, teacher) == str(config.rollout.name) else {}
    return {**run_node, "model_path": str(Path(teacher.model_path).resolve()), "load_weights": True, **own}


def teacher_component(config: Any, teacher: TeacherConfig, total_steps: int) -> tuple[str, str, dict[str, Any]]:
    """``(kind, registered name, factory node)`` of what serves a teacher."""
    if teacher.scorer == "rollout":
        return "rollout", teacher_rollout(config, teacher), rollout_node(config, teacher)
    return "engine", teacher_engine(config, teacher), engine_node(config, teacher, total_steps)


def same_vocabulary(policy: Any, teacher: Any) -> bool:
    """Whether the teacher's tokenizer reads the policy's ids as the same tokens: vocabulary and special tokens."""
    specials = ("bos_token_id", "eos_token_id", "pad_token_id")
    return policy.get_vocab() == teacher.get_vocab() and all(getattr(policy, name, None) == getattr(teacher, name, None)
                                                              for name in specials)


def check_teacher(config: Any, name: str, teacher: TeacherConfig, top_k: int) -> None:
    """A teacher's model and tokenizer exist and read the policy's ids; its vocabulary holds ``top_k`` tokens."""
    import json

    from transformers import AutoTokenizer

    from rlplat.config import ConfigError

    where = f"distillation.teachers.{name}"
    if teacher.model_path is None:
        raise ConfigError(f"{where}.model_path: each teacher needs a local Hugging Face model directory.")
    model = Path(teacher.model_path)
    if not (model / "config.json").is_file():
        raise ConfigError(f"{where}.model_path: {teacher.model_path} is not a local Hugging Face model directory (no config.json there).")
    if teacher.retokenize == "text":
        raise ConfigError(f"{where}.retokenize=text: scoring the decoded text with the teacher's own tokenizer (and aligning "
                          "its tokens with the policy's) is not built; use a teacher that shares the policy's tokenizer.")
    tokenizer_path = Path(teacher.tokenizer_path or teacher.model_path)
    policy_path = config.model.tokenizer_path or config.model.path
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        policy_tokenizer = AutoTokenizer.from_pretrained(str(policy_path))
    except Exception as error:
        raise ConfigError(f"{where}: its tokenizer ({tokenizer_path}) or the policy's ({policy_path}) does not load: {error}") from None
    if not same_vocabulary(policy_tokenizer, teacher_tokenizer):
        raise ConfigError(f"{where}: its tokenizer ({tokenizer_path}) is not the policy's ({policy_path}): the vocabularies "
                          "or special tokens differ, so it cannot score the policy's token ids. Distil from a teacher "
                          "of the same tokenizer (retokenize=text, scoring by text with alignment, is not built).")
    vocabulary = json.loads((model / "config.json").read_text()).get("vocab_size")
    if vocabulary is not None and len(policy_tokenizer) > int(vocabulary):
        raise ConfigError(f"{where}: the policy's tokenizer has {len(policy_tokenizer)} tokens and the teacher's model "
                          f"only {vocabulary} logits.")
    if vocabulary is not None and top_k > int(vocabulary):
        raise ConfigError(f"distillation.top_k={top_k} is more than teacher {name}'s vocabulary ({vocabulary}).")


def distillation_nodes(config: Any) -> list:
    """The run's plugin nodes of the teachers (each teacher's engine node, checked against its engine's schema),
    after the checks that need the whole config (see :func:`check_run`)."""
    from rlplat.config import PluginNode, entry_schema

    settings = read_distillation(config)
    check_run(config, settings)
    nodes = []
    total_steps = int(config.trainer.total_training_steps or 0)
    for name, teacher in settings.teachers.items():
        where = f"distillation.teachers.{name}"
        kind, registered, node = teacher_component(config, teacher, total_steps)
        schema, owner = entry_schema(kind, registered, f"{where}.{kind}")
        if kind == "rollout":
            build = {"model_path": f"{where}.model_path", "load_weights": "(a teacher loads its own weights)"}
            nodes.append(PluginNode(f"{where}.rollout_config", owner, schema, node, build, tuple(teacher.rollout_config)))
            continue
        build = {"model_path": f"{where}.model_path", "lora": "(none for a teacher)",
                 "value_model": "(a teacher is a causal LM)", "reward_model": "(a teacher is a causal LM)"}
        nodes.append(PluginNode(f"{where}.engine_config", owner, schema, node, build, tuple(teacher.engine_config)))
    return nodes


def check_run(config: Any, settings: DistillationConfig) -> None:
    """Teachers and distillation losses come together; a top-k loss has a ``top_k``; every teacher loads and
    reads the policy's ids; a teacher in a pool of its own needs Ray."""
    from rlplat import registry
    from rlplat.config import ConfigError

    modes = loss_modes(config)
    distilling = [mode for mode in modes if mode in DISTILLATION_LOSSES]
    topk = [mode for mode in modes if mode in TOPK_LOSSES]
    if not settings.enabled:
        if distilling:
            raise ConfigError(f"the actor loss uses {', '.join(distilling)}, which reads a teacher's log-probs, and "
                              "distillation.teachers names none: add one (distillation.teachers.<name>.model_path=...).")
        return
    if not distilling:
        raise ConfigError(f"distillation.teachers names {', '.join(settings.teachers)}, and the actor loss has no distillation "
                          f"term to use them: add one to actor.loss.terms ({', '.join(DISTILLATION_LOSSES)}), e.g. "
                          "actor.loss.terms='[{loss_mode: reverse_kl, coef: 1.0}]'.")
    if topk and settings.top_k == 0:
        raise ConfigError(f"the actor loss uses {', '.join(topk)}, which reads the teacher's top-k log-probs: set "
                          "distillation.top_k (the vocabulary size for the whole distribution).")
    if settings.top_k and not topk:
        raise ConfigError(f"distillation.top_k={settings.top_k}: no term of the actor loss reads the teacher's top-k "
                          f"({', '.join(TOPK_LOSSES)}); set it to 0.")
    roles = config.get("roles") or {}
    if (roles.get("teacher") or {}).get("placement") == "separate" and config.cluster.backend == "local":
        raise ConfigError("roles.teacher.placement=separate needs cluster.backend=ray (the local backend is one process).")
    def implementation(kind: str, registered: str, where: str) -> Any:
        try:
            return registry.get(kind, registered)
        except Exception as error:
            raise ConfigError(f"{where}: {error}") from None

    for name, teacher in settings.teachers.items():
        where = f"distillation.teachers.{name}"
        if teacher.scorer == "rollout":
            rollout = teacher_rollout(config, teacher)
            served_by = implementation("rollout", rollout, f"{where}.rollout")
            if not getattr(served_by, "scores_tokens", False):
                raise ConfigError(f"{where}: rollout {rollout!r} does not score given tokens "
                                  "(RolloutEngine.scores_tokens); serve the teacher with scorer=engine, or a rollout that does (hf, vllm).")
            if not getattr(served_by, "scores_at_any_temperature", True) and float(config.rollout.temperature) != 1.0:
                raise ConfigError(f"{where}: rollout {rollout!r} scores the raw logits only (temperature 1), and teachers score at "
                                  f"rollout.temperature={config.rollout.temperature}; serve the teacher with scorer=engine, or "
                                  "sample at temperature 1.")
        else:
            engine = teacher_engine(config, teacher)
            if topk:
                features = getattr(implementation("engine", engine, f"{where}.engine"), "features", frozenset())
                if "top_k" not in features:
                    raise ConfigError(f"distillation.teachers.{name}: engine {engine!r} does not return top-k log-probs "
                                      f"(its features: {sorted(features) or 'none'}); a top-k loss needs one that does (fsdp2, megatron).")
        check_teacher(config, name, teacher, settings.top_k)


def plan(config: Any, gpu: bool) -> list:
    """The teachers' components of ``rlplat plan`` (the ``teacher`` role's ``metadata["plan"]``): each teacher's
    engine, forward only, in the teacher role's pool; resident only while the teachers score when they sleep."""
    from rlplat.contracts.role import read_role_config
    from rlplat.contracts.memory import PlannedComponent

    settings = read_distillation(config)
    if not settings.enabled:
        return []
    role = read_role_config(config, "teacher")
    total_steps = int(config.trainer.total_training_steps or 0)
    sleeping = ("teacher",) if settings.sleep and gpu and role.placement == "colocated" else None
    components = []
    for name, teacher in settings.teachers.items():
        kind, registered, node = teacher_component(config, teacher, total_steps)
        components.append(PlannedComponent(kind, registered, "teacher", role.placement, role.nnodes, role.devices_per_node,
                                           f"distillation.teachers.{name}", node, str(teacher.model_path), "teacher",
                                           sleeping if kind == "engine" else None))
    return components


def check(settings: DistillationConfig, config: Any) -> None:
    """The ``distillation`` node's check (kind ``config_node``): done by :func:`distillation_nodes`, which the
    config's node loop runs first."""
