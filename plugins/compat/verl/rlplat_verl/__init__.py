"""verl's dotted config keys, translated into rlplat's.

A verl user's command line (``actor_rollout_ref.actor.optim.lr=1e-6 data.train_batch_size=1024
trainer.n_gpus_per_node=8 ...``) or a YAML file in verl's layout (top-level ``actor_rollout_ref``)
becomes rlplat's keys before :func:`rlplat.config.load_config` sees them. Every verl key meets one rule of
:data:`RULES` (:mod:`rlplat_verl.table`), which does one of four things:

* **maps** it to rlplat's key, with the value as written (``actor_rollout_ref.actor.optim.lr`` ->
  ``actor.optim.lr``) or converted where the units or conventions differ (verl's ``top_k=-1`` is rlplat's
  ``top_k=0``; verl steps its LR schedule once per training step, rlplat once per optimizer step);
* **accepts and ignores** it, when the value asks for what rlplat does anyway or the key only tunes verl's
  own machinery (kernels, logging, timeouts) and cannot change what is trained or whether it fits;
* **refuses** it, naming it: rlplat has no equivalent. All refusals of one command line are raised together
  in one :class:`rlplat.config_node.ConfigError`, so the user sees every one at once;
* leaves it **unchanged**: the key is rlplat's already, with the same meaning (``data.train_batch_size``,
  ``algorithm.adv_estimator``, ``trainer.total_epochs``).

Each translation comes with a one-line note (``verl key actor_rollout_ref.actor.optim.lr ->
actor.optim.lr``) that the CLI prints. A key under a node only verl has (``actor_rollout_ref``,
``reward_model``, ...) and no rule is refused; any other key without a rule passes unchanged, and the
config loader judges it. Hydra's ``+key=value`` and ``++key=value`` lose their prefix (rlplat's keys all
exist, so there is nothing to add); ``~key`` (delete) is refused.

Some rules read the rest of the command line (and the ``--config`` file): ``data.truncation`` yields to
``data.filter_overlong_prompts=True``, the reference model's ``fsdp_config`` must match the actor's, the
reward model's and LoRA's settings are read only when they are on, the two multi-turn turn limits give one
``agent.loops.tool.max_turns``, ``trainer.v1``'s sampler is read only in the asynchronous modes,
``distillation.enabled`` writes one term of ``actor.loss.terms`` from every key of verl's
``distillation.distillation_loss``, and a verl-style command line whose ``algorithm.adv_estimator`` implies an
rlplat algorithm (``gae`` -> ``ppo``) selects it unless ``--algo`` or ``algorithm.name`` does.

Registered as the config translator ``verl`` (kind ``config_translator``): ``rlplat run``, ``plan`` and
``config`` apply it to every command line (:func:`translate_command_line`); without this distribution
installed a verl key is an unknown key like any other.

The modules, a table split by verl's nodes so that a reader finds every verl key and its fate in one place
and a test checks the whole table against rlplat's schemas and the docs: :mod:`rlplat_verl.rules` (what a
rule is made of), :mod:`rlplat_verl.training_keys`, :mod:`rlplat_verl.rollout_keys`, :mod:`rlplat_verl.run_keys`
and :mod:`rlplat_verl.distillation_keys` (the rules), :mod:`rlplat_verl.table` (:data:`RULES`, the Markdown table
of ``docs/coming-from-verl.md``) and :mod:`rlplat_verl.translate` (a command line and a YAML file translated).
They import only the standard library and omegaconf: translation runs before anything heavy.

Every public name of those modules is an attribute of this package too, resolved on first use (the names
of ``rlplat.verl_keys``, the module this distribution replaced). Importing the package imports nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Where the package's attributes are looked up, in order.
MODULES = ("translate", "table", "rules", "training_keys", "rollout_keys", "run_keys", "distillation_keys")
_ABSENT = object()


def __getattr__(name: str) -> Any:
    if not name.startswith("_"):
        for module in MODULES:
            value = getattr(importlib.import_module(f"{__name__}.{module}"), name, _ABSENT)
            if value is not _ABSENT:
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
