"""The built-in demo (distribution rlplat-demo): a tiny arithmetic model and its task data, shipped inside
the package, and the presets ``rlplat run --demo NAME`` trains (registered as kind ``preset`` by
:mod:`rlplat_demo.plugin`, with the tool demo's scorer ``tool_demo``).

The assets under ``assets/`` are produced by ``python -m rlplat_demo.build`` (see :mod:`rlplat_demo.build`):

* ``assets/model/``: a 0.53M-parameter Qwen2 causal LM and its 16-token arithmetic tokenizer, warm-started
  by supervised steps until greedy validation accuracy passes a threshold, so that RL has signal;
* ``assets/data/train.parquet`` and ``assets/data/val.parquet``: ``a+b=`` prompts with two 2-digit operands,
  in the schema of :mod:`rlplat.data` (``data_source="arith"``), the validation pairs disjoint from training;
* ``assets/build_info.json``: how they were built (seed, steps, validation accuracy, sizes);
* ``assets/teacher/``: the ``arith`` preset's own run exported at its best validated step (greedy validation
  accuracy 0.825), the teacher of the ``distill`` presets (:func:`rlplat_demo.build.build_teacher`);
* ``assets/reward_model/``: a reward model for the same task, trained from the warm-started policy on correct
  vs incorrect answers (:mod:`rlplat_demo.reward_model`), for ``rlplat run --demo reward-model``.

The demo's reward is the default scorer, ``exact_match`` (:func:`rlplat.scorers.exact_match`).
:func:`overrides` is the demo's preset ``arith``, the default one: what ``rlplat run`` and ``rlplat config
show`` use when no model or config is given; :func:`preset` gives any of :data:`PRESETS`. Importing this
package imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

BUILD_COMMAND = "python -m rlplat_demo.build"


class DemoAssetsMissing(FileNotFoundError):
    """The demo's shipped assets are not where the installed package expects them."""


def assets_dir() -> Path:
    """The folder of the demo's assets inside the installed package."""
    return _existing(Path(__file__).resolve().parent / "assets", "the demo assets folder")


def model_dir() -> Path:
    """The demo model's ``save_pretrained`` folder (model and tokenizer), for ``from_pretrained``."""
    return _existing(assets_dir() / "model" / "config.json", "the demo model").parent


def reward_model_dir() -> Path:
    """The demo reward model's ``save_pretrained`` folder (a one-label Qwen2 sequence classifier and the
    arithmetic tokenizer), trained by ``python -m rlplat_demo.build --only reward-model``."""
    return _existing(assets_dir() / "reward_model" / "config.json", "the demo reward model").parent


def teacher_dir() -> Path:
    """The demo teacher's ``save_pretrained`` folder (a Qwen2 causal LM of the demo model's shape and the
    arithmetic tokenizer), for on-policy distillation: the ``arith`` preset's own run (``rlplat run --demo
    arith``, GRPO from :func:`model_dir`), exported at its validated step of highest greedy validation
    accuracy, at least 0.8; built by ``python -m rlplat_demo.build --only teacher`` (``build_info.json``,
    ``"teacher"``, records the run)."""
    return _existing(assets_dir() / "teacher" / "config.json", "the demo teacher").parent


def train_file() -> Path:
    """The demo's training prompts (parquet)."""
    return _existing(assets_dir() / "data" / "train.parquet", "the demo training data")


def val_file() -> Path:
    """The demo's validation prompts (parquet), disjoint from the training prompts."""
    return _existing(assets_dir() / "data" / "val.parquet", "the demo validation data")


def overrides() -> list[str]:
    """The demo's settings (measured in DEMO_NOTES.md) as dotted overrides; a user's own come after them
    and win. The reward is left to the default scorer, so ``reward.scorer=...`` or a custom function
    given by the user replaces it without a conflict."""
    return [
        f"model.path={model_dir()}",
        f"data.train_files=[{train_file()}]",
        f"data.val_files=[{val_file()}]",
        "data.train_batch_size=32", "data.max_prompt_length=16",
        "rollout.n=8", "rollout.response_length=4", "rollout.temperature=1.0",
        "actor.optim.lr=1.5e-4", "actor.ppo_mini_batch_size=32", "actor.micro_batch_size_per_gpu=256",
        "actor.optim.weight_decay=0.0", "actor.loss.use_kl_loss=false", "actor.loss.loss_agg_mode=token-mean",
        "actor.optim.lr_scheduler_type=cosine", "actor.optim.min_lr_ratio=0.0",
        "trainer.total_training_steps=850", "trainer.test_freq=25", "trainer.save_freq=425",
        "trainer.output_dir=runs/demo", "cluster.backend=local",
    ]


DEFAULT_PRESET = "arith"
"""The preset a command runs without ``model.path`` or ``--config``."""

PRESETS = {
    "arith": "GRPO on a+b= with the 0.53M-parameter arithmetic model (the default)",
    "reward-model": "the arithmetic demo rewarded by the demo's reward model alone (exact match only measures validation)",
    "tools": "GRPO through the tool agent loop: a*b= with a calculator the model learns to call",
    "retry": "GRPO through the env agent loop: a+b= with up to 3 attempts, 'wrong, try again' after a wrong one",
    "retry-single": "the retry demo's task, model and steps with one attempt (its single-turn baseline)",
    "tools-blackbox": "the tools demo with its agent written against the openai client, trained through the gateway",
    "distill": "on-policy distillation: the arithmetic warm start learns from the demo's teacher (0.825), no reward",
    "distill-rl": "the distill demo with GRPO's reward mixed in (both terms weigh 1)",
}
"""The built-in demos ``rlplat run --demo NAME`` trains (``make demo``, ``make demo-tools``)."""


def preset(name: str) -> list[str]:
    """The dotted overrides of the demo ``name`` (one of :data:`PRESETS`)."""
    if name == "arith":
        return overrides()
    if name == "reward-model":
        return overrides() + [f"reward.model.path={reward_model_dir()}", "reward.model.rule_weight=0",
                              "reward.model.micro_batch_size_per_gpu=256",
                              "trainer.output_dir=runs/demo-reward-model"]
    if name in ("distill", "distill-rl"):
        return overrides() + distillation_overrides(name)
    if name not in PRESETS:
        raise ValueError(f"unknown demo {name!r}; the demos are {', '.join(PRESETS)}")
    from rlplat_demo import tools

    common = [
        f"model.path={tools.model_dir()}", "cluster.backend=local", "algorithm.name=grpo",
        "actor.optim.weight_decay=0.0", "actor.loss.use_kl_loss=false", "actor.loss.loss_agg_mode=token-mean",
        "rollout.temperature=1.0", "rollout.n=8", "rollout.response_length=40", "data.train_batch_size=16",
        "data.max_prompt_length=16", "agent.max_prompt_length=32", "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size_per_gpu=128", "trainer.total_training_steps=20", "trainer.test_freq=5",
        "trainer.save_freq=0",
        # conversations of many lengths: padded micro-batches beat one attention call per length group here
        "actor.engine_config.use_remove_padding=false",
    ]
    if name == "tools":
        return common + [
            f"data.train_files=[{tools.data_file('train')}]", f"data.val_files=[{tools.data_file('val')}]",
            f"agent.tools_config={tools.tools_config_file()}", "agent.loops.tool.max_turns=2",
            "actor.optim.lr=5e-4", "trainer.output_dir=runs/demo-tools",
        ]
    if name == "tools-blackbox":
        return common + [
            f"data.train_files=[{tools.data_file('train')}]", f"data.val_files=[{tools.data_file('val')}]",
            "agent.loop_names={tool: blackbox}", "agent.loops.blackbox.agent=rlplat_demo.agents:calculator_agent",
            "agent.loops.blackbox.agent_kwargs.max_turns=2", "actor.optim.lr=5e-4",
            "trainer.output_dir=runs/demo-tools-blackbox",
        ]
    attempts = 3 if name == "retry" else 1
    return common + [
        f"data.train_files=[{tools.data_file('env_train')}]", f"data.val_files=[{tools.data_file('env_val')}]",
        "agent.loop=env", "agent.environment=retry", f"agent.loops.env.max_turns={attempts}",
        "actor.optim.lr=2e-5", f"trainer.output_dir=runs/demo-{name}",
    ]


def distillation_overrides(name: str) -> list[str]:
    """The ``distill`` demo (``distill-rl``: with the reward's GRPO term too) after the ``arith`` preset: the
    student is the warm start, the teacher :func:`teacher_dir`, the term the reverse KL over the teacher's
    whole distribution (``top_k`` = the 16-token vocabulary), 100 steps."""
    return [
        f"distillation.teachers.arith.model_path={teacher_dir()}", "distillation.top_k=16",
        "actor.loss.terms=[{loss_mode: reverse_kl_topk, coef: 1.0}]",
        f"actor.loss.policy_loss_coef={0 if name == 'distill' else 1}",
        "trainer.total_training_steps=100", "trainer.test_freq=10", "trainer.save_freq=0",
        f"trainer.output_dir=runs/demo-{name}",
    ]


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise DemoAssetsMissing(
            f"{what} is missing: {path} does not exist. The demo assets ship with rlplat-demo; in a source checkout "
            f"regenerate them with `{BUILD_COMMAND}`, or reinstall rlplat-demo"
        )
    return path
