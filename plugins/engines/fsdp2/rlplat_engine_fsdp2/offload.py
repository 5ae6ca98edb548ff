"""Parameter and optimizer-state offload (``param_offload``, ``optimizer_offload``): the engine's methods that move
them to CPU memory between calls and back. On a CPU device nothing moves.

:class:`Offload` is a base class of :class:`~rlplat_engine_fsdp2.engine.FSDP2Engine`; it reads the engine's
``config``, ``module``, ``optimizer`` and ``device``, and keeps ``params_offloaded`` / ``optimizer_offloaded``.
"""

from __future__ import annotations

import torch


class Offload:
    """``offload`` / ``onload`` of the contract, and the per-part moves the engine's calls make around their work:
    each call onloads what it touches and offloads it again afterwards when the config asks (``*_if_configured``)."""

    def offload(self) -> None:
        self.offload_parameters()
        self.offload_optimizer()

    def onload(self) -> None:
        self.onload_parameters()
        self.onload_optimizer()

    def offload_parameters(self) -> None:
        if self.device.type == "cpu" or self.params_offloaded:
            return
        self.module.to("cpu")
        self.params_offloaded = True
        torch.cuda.empty_cache()

    def onload_parameters(self) -> None:
        if self.params_offloaded:
            self.module.to(self.device)
            self.params_offloaded = False

    def offload_optimizer(self) -> None:
        if self.device.type == "cpu" or self.optimizer_offloaded:
            return
        move_optimizer_state(self.optimizer, torch.device("cpu"))
        self.optimizer_offloaded = True
        torch.cuda.empty_cache()

    def onload_optimizer(self) -> None:
        if self.optimizer_offloaded:
            move_optimizer_state(self.optimizer, self.device)
            self.optimizer_offloaded = False

    def offload_parameters_if_configured(self) -> None:
        if self.config.param_offload:
            self.offload_parameters()

    def offload_optimizer_if_configured(self) -> None:
        if self.config.optimizer_offload:
            self.offload_optimizer()


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
