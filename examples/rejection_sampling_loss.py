"""The loss of ``examples/rejection_sampling.py``, in a module of the example's own.

Nothing installs this module: the example ships it to the Ray workers with
``start_ray(py_modules=[rejection_sampling_loss])`` and passes an instance to
``update_actor(batch, loss_fn=...)``, which sends the object to every worker by value; the worker
needs this module to rebuild its class. Without the shipping a worker on another machine (or any
worker, once this folder is not on its ``sys.path``) fails with ``ModuleNotFoundError``.
"""

from __future__ import annotations

from typing import Any, Mapping

from rlplat.losses import aggregate_loss


class AcceptedResponsesLoss:
    """Token-mean negative log-likelihood of the accepted responses:
    ``-sum(log_probs * response_mask) / global_token_count``.

    The engine calls it once per micro-batch with ``global_token_count``, the valid response tokens of
    the whole mini-batch over every micro-batch and worker, so the gradients it sums are those of the
    unsplit mini-batch whatever the split. Reads ``response_mask`` from the micro-batch and
    ``log_probs`` from the engine's outputs; reports ``rejection_sampling/nll``, the loss itself (a
    globally normalised value: the engine's sum over micro-batches and workers is the mini-batch's NLL).
    """

    needs_entropy = False

    def __call__(self, outputs: Mapping[str, Any], micro_batch: Any) -> tuple[Any, dict[str, float]]:
        loss = aggregate_loss(-outputs["log_probs"], micro_batch.batch["response_mask"], "token-mean",
                              global_token_count=micro_batch.meta_info["global_token_count"])
        return loss, {"rejection_sampling/nll": float(loss.detach())}
