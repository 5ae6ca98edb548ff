"""Mixed into vLLM's worker class (the engine argument ``worker_extension_cls``) for the ``load`` weight path:
the rollout opens vLLM's update bracket (``start_weight_update``, which prepares vLLM's layerwise reload),
hands each bucket to :meth:`WeightLoader.rlplat_load_weights` through ``collective_rpc``, then closes it
(``finish_weight_update``, which processes every reloaded layer, e.g. re-packs the CPU backend's weights).

Imported by vLLM inside its worker (this process when the engine runs in process, else vLLM's engine
process or the server's), never by rlplat itself.
"""

from __future__ import annotations

import os
from typing import Any, Iterable


class WeightLoader:
    def rlplat_load_weights(self, source: str | Iterable[tuple[str, Any]]) -> int:
        """Load one bucket into the model with the model's own ``load_weights`` (checkpoint names, fused
        layers split as when vLLM loads a checkpoint). ``source``: the ``(name, tensor)`` pairs (an engine in
        this process), or the path of a safetensors file, which is removed once read. Returns the number
        of tensors loaded."""
        if isinstance(source, str):
            from safetensors.torch import load_file

            try:
                tensors = list(load_file(source).items())
            finally:
                os.unlink(source)
        else:
            tensors = list(source)
        self.model_runner.model.load_weights(weights=iter(tensors))
        return len(tensors)
