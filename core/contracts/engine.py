"""The training-engine contract: what the actor, reference and critic workers need from a trainer.

DataProto keys (verl's names) are listed per method. Shapes: ``B`` rows, ``P`` prompt tokens (left
padded), ``R`` response tokens (right padded), ``T = P + R``. All log-probs are float32.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol

if TYPE_CHECKING:
    import torch

    from rlplat.protocol import DataProto


class LossFunction(Protocol):
    """What :meth:`TrainingEngine.train_batch` calls once per micro-batch.

    ``outputs`` holds what :meth:`TrainingEngine.forward` would return for the micro-batch, with
    gradients: ``log_probs`` [b, R], and ``entropy`` [b, R] when asked, ``values`` [b, R] for a value
    model. ``micro_batch.meta_info`` carries ``global_token_count`` (valid response tokens of the whole
    mini-batch summed over every data-parallel rank) and ``global_sequence_count`` (its rows with at
    least one valid response token, over every rank), so the returned loss can be normalised globally: the engine *sums* gradients over
    micro-batches and ranks, which makes every aggregation mode independent of how the mini-batch was
    split. Returns ``(loss, metrics)``: a scalar tensor and a dict of floats for logging.

    Metrics are contributions, like the loss: the engine *sums* each metric over the micro-batches and
    ranks of a mini-batch (and averages over optimizer steps). A globally normalised quantity (the loss
    and its parts) is reported as it is; a mean over the micro-batch's tokens is scaled by the
    micro-batch's share of ``global_token_count``. Every metric is then independent of the split too.
    """

    def __call__(self, outputs: Mapping[str, "torch.Tensor"], micro_batch: "DataProto") -> tuple["torch.Tensor", dict[str, float]]: ...


class TrainingEngine(abc.ABC):
    """A model with its optimizer and schedule, sharded over the data-parallel ranks of its worker group.

    Built by the registry factory from ``(config, **kwargs)``; the constructor only records the config.
    :meth:`init_model` runs inside the worker process after ``torch.distributed`` is set up.
    """

    @abc.abstractmethod
    def init_model(self) -> None:
        """Build the model (from ``model.path``, a local Hugging Face directory, or from a config),
        the optimizer and the LR schedule; deterministic under the configured seed."""

    @abc.abstractmethod
    def forward(self, batch: "DataProto", *, temperature: float = 1.0, calculate_entropy: bool = False) -> "DataProto":
        """Evaluate without gradients.

        Reads ``input_ids``, ``attention_mask``, ``position_ids`` [B, T] and ``responses`` [B, R].
        Returns a new DataProto with ``log_probs`` [B, R] (log-probabilities of the response tokens
        under logits divided by ``temperature``, exactly as the rollout samples), ``entropy`` [B, R]
        when ``calculate_entropy``, and ``values`` [B, R] for a value model. Row order is preserved.
        """

    @abc.abstractmethod
    def train_batch(self, batch: "DataProto", loss_fn: LossFunction) -> dict[str, float]:
        """One optimizer step per mini-batch of ``batch`` (``meta_info["ppo_mini_batch_size"]`` rows,
        ``meta_info["ppo_epochs"]`` passes), accumulating gradients over micro-batches (fixed size or a
        token budget), clipping them and stepping the LR schedule.

        Reads what ``loss_fn`` needs (typically ``responses``, ``response_mask``, ``old_log_probs``,
        ``advantages``, ``ref_log_prob``, ``values``, ``returns``) plus the model inputs. Returns
        metrics averaged over steps: at least ``grad_norm`` and ``lr`` and the loss function's own.
        """

    @abc.abstractmethod
    def named_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
        """Full (unsharded) parameters in Hugging Face naming, yielded in buckets of at most
        ``bucket_bytes`` (a single tensor larger than that forms its own bucket), for the rollout."""

    @abc.abstractmethod
    def save(self, path: str) -> None:
        """Write a resumable, sharded checkpoint (model, optimizer, LR schedule, RNG) into ``path``."""

    @abc.abstractmethod
    def load(self, path: str) -> None:
        """Restore exactly what :meth:`save` wrote; raises if ``path`` is missing or incomplete."""

    @abc.abstractmethod
    def export_hf(self, path: str) -> None:
        """Write a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads."""

    @abc.abstractmethod
    def offload(self) -> None:
        """Move parameters and optimizer state off the accelerator between phases (no-op on CPU)."""

    @abc.abstractmethod
    def onload(self) -> None:
        """Undo :meth:`offload`."""

    def state(self) -> Mapping[str, Any]:
        """Small facts for logging (``step``, ``lr``, parameter count); override to add more."""
        return {}
