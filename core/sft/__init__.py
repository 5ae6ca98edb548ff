"""Supervised fine-tuning on the training engines (``rlplat sft``): the first stage of an RL pipeline.

* :mod:`rlplat.sft.config`: the typed config (``data`` and ``loss`` nodes of its own; ``model``,
  ``actor``, ``trainer`` and ``cluster`` keys shared with ``rlplat run``), :func:`load_sft_config`.
* :mod:`rlplat.sft.data`: parquet conversations (``messages`` with tool calls, or ``prompt`` /
  ``response``) rendered with the tokenizer's chat template, the loss on assistant tokens only.
* :mod:`rlplat.sft.worker`: the worker that trains any engine through its ``train_batch`` with
  :class:`rlplat.losses.NLLLoss`.
* :mod:`rlplat.sft.trainer`: the loop (validation loss and perplexity, metrics, checkpoints with exact
  resume, a Hugging Face export ``rlplat run`` takes as ``model.path``), :func:`run_sft`.

Names resolve lazily: ``import rlplat.sft`` imports no torch.
"""

from __future__ import annotations

from rlplat.lazy_names import lazy_names

_LAZY_NAMES: dict[str, str] = {
    "SFTConfig": "rlplat.sft.config",
    "load_sft_config": "rlplat.sft.config",
    "validate_sft_config": "rlplat.sft.config",
    "SFTDataConfig": "rlplat.sft.data",
    "SFTDataset": "rlplat.sft.data",
    "ExampleEncoder": "rlplat.sft.data",
    "collate_examples": "rlplat.sft.data",
    "SFTWorker": "rlplat.sft.worker",
    "SFTTrainer": "rlplat.sft.trainer",
    "run_sft": "rlplat.sft.trainer",
}

__all__ = sorted(_LAZY_NAMES)

__getattr__, __dir__ = lazy_names("rlplat.sft", _LAZY_NAMES, globals())
