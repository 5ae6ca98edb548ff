"""Supervised fine-tuning on the training engines (``rlplat sft``): the first stage of an RL pipeline.

* :mod:`rlplat_sft.config`: the typed config (``data`` and ``loss`` nodes of its own; ``model``,
  ``actor``, ``trainer`` and ``cluster`` keys shared with ``rlplat run``), :func:`load_sft_config`.
* :mod:`rlplat_sft.data`: parquet conversations (``messages`` with tool calls, or ``prompt`` /
  ``response``) rendered with the tokenizer's chat template, the loss on assistant tokens only.
* :mod:`rlplat_sft.worker`: the worker that trains any engine through its ``train_batch`` with
  :class:`rlplat.losses.NLLLoss`.
* :mod:`rlplat_sft.trainer`: the loop (validation loss and perplexity, metrics, checkpoints with exact
  resume, a Hugging Face export ``rlplat run`` takes as ``model.path``), :func:`run_sft`.

Names resolve lazily: ``import rlplat_sft`` imports no torch.
"""

from __future__ import annotations

from rlplat.lazy_names import lazy_names

_LAZY_NAMES: dict[str, str] = {
    "SFTConfig": "rlplat_sft.config",
    "load_sft_config": "rlplat_sft.config",
    "validate_sft_config": "rlplat_sft.config",
    "SFTDataConfig": "rlplat_sft.data",
    "SFTDataset": "rlplat_sft.data",
    "ExampleEncoder": "rlplat_sft.data",
    "collate_examples": "rlplat_sft.data",
    "SFTWorker": "rlplat_sft.worker",
    "SFTTrainer": "rlplat_sft.trainer",
    "run_sft": "rlplat_sft.trainer",
}

__all__ = sorted(_LAZY_NAMES)

__getattr__, __dir__ = lazy_names("rlplat_sft", _LAZY_NAMES, globals())
