"""The rollout-engine contract: generation with the current policy weights.

Prompts arrive left padded; responses leave right padded. ``B`` prompts, ``n`` samples per prompt,
``P`` prompt tokens, ``R`` = ``max_new_tokens``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence

if TYPE_CHECKING:
    import torch

    from rlplat.contracts.memory import MemoryContext, MemoryEstimate
    from rlplat.protocol import DataProto



@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What :meth:`RolloutEngine.weight_fingerprints` reports of one tensor it holds: its dtype, element count,
    and the float64 sum, sum of absolute values and sum of squares of its elements (computed by
    :func:`rlplat.kits.weights.fingerprint`, compared with the actor's after a weight sync)."""

    dtype: str
    numel: int
    total: float
    absolute: float
    squares: float

@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k=0`` and ``top_p=1.0`` disable those filters; ``greedy`` ignores the
    temperature and takes the arg-max; ``seed`` makes sampling reproducible on the same engine."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    greedy: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.temperature <= 0 and not self.greedy:
            problems.append(f"temperature must be > 0 (or set greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))


@dataclasses.dataclass
class RolloutBuildConfig:
    """The keys every rollout factory receives from the run config: the trainer builds the rollout with
    ``registry.get("rollout", name)({**build_config, **rollout.config})``. A rollout's registered
    ``config_schema`` extends this class with its own keys (set under ``rollout.config``); ``load_config``
    checks the combined node against it before any worker starts."""

    model_path: Optional[str] = None
    """``model.path``: the policy's local Hugging Face directory (config and tokenizer files)."""
    load_weights: bool = True
    """Load the weights in ``model_path``; the trainer passes False, since the training engine syncs its
    weights in before the first generation."""
    record_routes: bool = False
    """With a mixture-of-experts model, ``generate`` adds ``routed_experts`` (:mod:`rlplat.kits.moe`): the
    experts each token was routed to. The trainer sets it for ``actor.moe.router_replay=r3``, only with a
    rollout whose registry metadata has ``"records_routes": True``; others may ignore it."""


@dataclasses.dataclass(frozen=True)
class TokenOutput:
    """Result of :meth:`RolloutEngine.generate_tokens`: the new tokens (stop token included when one
    ended generation), the log-probability of each under the sampling distribution, and why it ended
    (``"stop"`` or ``"length"``; ``"abort"`` when :meth:`RolloutEngine.abort_generation` cut it short: the
    tokens so far, to be continued from their prefix)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    versions: Optional[list[int]] = None
    """Per token, the weights version it was sampled with (:meth:`RolloutEngine.set_weights_version`), for a
    rollout whose weights can change during a generation; None: one version throughout."""


class RolloutEngine(abc.ABC):
    """Generates responses with the policy's current weights; lives in the same process as the
    training engine (hybrid) or in its own. Built by the registry factory from ``(config, **kwargs)``."""

    @abc.abstractmethod
    def generate(self, prompts: "DataProto", sampling: SamplingParams) -> "DataProto":
        """Sample ``sampling.n`` responses per prompt.

        Reads ``input_ids``, ``attention_mask``, ``position_ids`` [B, P] (left padded). Returns a new
        DataProto of ``B * n`` rows, the samples of one prompt adjacent (interleaved repeat), with
        ``prompts`` [B*n, P], ``responses`` [B*n, R] (right padded with the pad token), ``response_mask``
        [B*n, R] (1 up to and including the EOS/stop token), ``rollout_log_probs`` [B*n, R] (log-probs
        of the sampled tokens under the distribution actually sampled from, 0 where masked), and the
        full ``input_ids`` / ``attention_mask`` / ``position_ids`` [B*n, P+R]. ``non_tensor_batch`` is
        repeated alongside.
        """

    @abc.abstractmethod
    async def generate_tokens(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TokenOutput:
        """Token in, token out, one sample (``sampling.n`` must be 1), for agent loops."""

    partial_rollout_modes: ClassVar[tuple[str, ...]] = ()
    """How generations in flight (``generate_tokens``) can go on when the weights change under them:
    ``keep`` (their KV cache stays; tokens from then on come from the new weights) and ``recompute`` (the
    cache is rebuilt from each prefix with the new weights). Empty: the rollout cannot, and the weights of
    such a rollout change between generations only."""

    def pause_generation(self) -> None:
        """Stop every generation in flight at its next token boundary, keeping it (for a weight update
        in between); :meth:`resume_generation` goes on. The default, for rollouts without
        :attr:`partial_rollout_modes`: nothing (their weights change between generations only)."""

    def resume_generation(self) -> None:
        """Go on after :meth:`pause_generation`."""

    def set_weights_version(self, version: int, mode: str = "keep") -> None:
        """Number the weights now loaded ``version`` (recorded per token in :attr:`TokenOutput.versions`),
        and say how generations in flight go on with them (one of :attr:`partial_rollout_modes`). The
        default: nothing."""

    def abort_generation(self) -> None:
        """End every ``generate_tokens`` call in flight or queued now, at a token boundary: each returns the
        tokens it has (possibly none), their log-probs and versions, with ``finish_reason="abort"`` (a
        checkpoint stores them and a resumed run continues them from their prefix). Calls made afterwards
        are served as usual. Required of rollouts with :attr:`partial_rollout_modes`; the default, for
        the others, does nothing (their generations are waited for)."""

    honours_seeds: bool = True
    """Whether ``SamplingParams.seed`` reproduces samples: the same seed on the same weights gives the same
    tokens, another seed others. False where the engine cannot on this platform or with these settings
    (SGLang outside its deterministic mode, and on CPUs): a seeded call then samples as an unseeded one,
    and a run with it cannot replay its samples. An instance may set it from its settings."""

    scores_tokens: ClassVar[bool] = False
    """Whether :meth:`score_tokens` is implemented (a distillation teacher can be served by this rollout)."""
    scores_at_any_temperature: ClassVar[bool] = True
    """Whether :meth:`score_tokens` honours a temperature other than 1. False: it scores the raw logits (vLLM's
    prompt log-probs) and refuses another temperature with a ``ValueError``; a run is refused at load instead."""

    def score_tokens(self, batch: "DataProto", *, temperature: float = 1.0, top_k: int = 0) -> "DataProto":
        """Log-probs of given tokens, nothing sampled: reads ``input_ids``, ``attention_mask``, ``position_ids``
        [B, P+R] (prompt left padded, response right padded) and ``responses`` [B, R]; returns ``log_probs``
        [B, R] (``log softmax(logits / temperature)`` at each response token, 0 at padding) and, with
        ``top_k`` > 0, ``top_k_log_probs`` and ``top_k_ids`` [B, R, k] (the ``k`` largest at each response
        position, descending). Only rollouts with :attr:`scores_tokens` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not score tokens (scores_tokens is False)")

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Load full tensors in Hugging Face naming (may be called once per bucket). Copy from them, never
        write into them or keep them: from another worker group they are read-only views of Ray's shared memory."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Free the weights and the KV cache so the training engine can use the memory."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed; weights must be updated again before generating."""

    def wake_up_weights(self) -> None:
        """First stage of a staged wake-up: allocate the weights only, so that the training engine's
        buckets can be loaded before the KV cache claims its memory (all at once holds both peaks and
        is where colocated runs run out of memory). Callers then :meth:`update_weights` and call
        :meth:`wake_up_kv_cache`. The default wakes everything."""
        self.wake_up()

    def wake_up_kv_cache(self) -> None:
        """Second stage of a staged wake-up, after the weights were updated. The default does nothing
        (an engine whose :meth:`wake_up_weights` restored everything)."""

    def bind_weights(self, named_tensors: Sequence[tuple[str, "torch.Tensor"]]) -> bool:
        """Optional zero-copy sync: make the model's weights *be* these tensors (views of the training
        engine's own parameters in the same process, from :meth:`TrainingEngine.shared_weights`), so an
        optimizer step is seen by the next generation with nothing copied; called again at every sync
        (cheap: it rebinds, it does not copy). Returns False (the default) when this engine cannot, or
        not for these tensors (another device or dtype, missing names): the caller then copies with
        :meth:`update_weights`. An engine that binds must keep the tensors untouched (no in-place
        writes, not freed by :meth:`sleep`) and take its own copy again before :meth:`update_weights`."""
        return False

    def weight_fingerprints(self) -> "Mapping[str, Fingerprint] | None":
        """What the rollout holds, for the run sentinel's check after each weight sync: the
        :func:`~rlplat.kits.weights.fingerprint` of every weight by the name :meth:`update_weights` takes
        (a tied weight under each of its names). None (the default): not supported, the sync is not checked
        (``sentinel/weights_verified`` is 0). Cost: one read of the weights."""
        return None

    def instance_id(self) -> "str | None":
        """Who is serving: a value that changes when the engine restarted and so lost the weights it was sent
        (a server process started again, a replica replaced). The worker compares it before every
        generation with the one it saw at the last acknowledged sync; a change makes the replica ``stale``: it
        is refreshed with the actor's weights before it serves, or refused (``StaleReplicaError``) where it
        cannot be. None (the default): an engine that never restarts on its own."""
        return None

    supports_adapters: ClassVar[bool] = False
    """Whether :meth:`load_adapter` works (``actor.lora.sync=adapter`` is checked against it at load)."""

    def load_adapter(self, config: Mapping[str, Any], named_tensors: Sequence[tuple[str, "torch.Tensor"]]) -> None:
        """Serve the base model with this LoRA adapter from now on (replacing the previous one): ``config``
        is ``peft``'s adapter config as a dict (``r``, ``lora_alpha``, ``target_modules``, ...), the tensors
        are in ``peft``'s naming (:meth:`TrainingEngine.adapter_weights`). Rollouts without adapters refuse."""
        raise RuntimeError(f"{type(self).__name__} cannot load LoRA adapters (RolloutEngine.supports_adapters); "
                           "use actor.lora.sync=merged")

    @classmethod
    def estimate_memory(cls, config: Mapping[str, Any], model_config: Mapping[str, Any],
                        context: "MemoryContext") -> "MemoryEstimate | None":
        """The memory one process of this rollout holds while generating and waking up, predicted before
        anything is built (``rlplat plan``): ``config`` is the ``rollout.config`` node as the factory
        would receive it, ``model_config`` the model's ``config.json`` as a dict, ``context`` the process
        count, device (and its memory, for rollouts that take a fraction of it), sequences per process
        and lengths (:class:`rlplat.contracts.memory.MemoryContext`). Reads no weights, allocates nothing.
        Returns a :class:`rlplat.contracts.memory.MemoryEstimate` with the weights and the KV cache; None
        (the default) when the rollout cannot say. As for
        :meth:`rlplat.contracts.engine.TrainingEngine.estimate_memory`, a registration's
        ``metadata={"estimate_memory": "package.memory:estimate"}`` is called instead, without importing
        the rollout's module."""
        return None


@dataclasses.dataclass
class RolloutDriverContext:
    """What a rollout driver gets in the rollout worker that builds it (once, at the first batch it drives)."""

    engines: Sequence[RolloutEngine]
    """The worker's rollout engines (one replica today), for ``generate`` and ``generate_tokens``."""
    node: Mapping[str, Any]
    """The run-config node the driver's entry names in ``metadata["config_node"]`` (e.g. ``agent``), as a
    plain mapping; empty when it names none."""
    tokenizer_path: Optional[str]
    """The policy's tokenizer (and chat template): ``model.tokenizer_path`` or ``model.path``."""
    prompt_length: int
    """``data.max_prompt_length``: the width of the prompts the data loader gives."""
    template_kwargs: Mapping[str, Any]
    """``data.apply_chat_template_kwargs``."""
    trajectory_scorer: Any = None
    """The run's reward manager's :meth:`~rlplat.contracts.reward.RewardManager.trajectory_scorer` (built in
    this worker), or None: then the trainer scores the batch."""
    policy_version: Optional[Callable[[], int]] = None
    """The policy version the worker's rollout samples from now; a driver that records versions per token
    returns them as ``policy_version`` (-1 on tokens not sampled, which the worker stamps)."""


class RolloutDriver(abc.ABC):
    """Turns a batch of prompts into a batch of trajectories through a worker's rollout engines (kind
    ``rollout_driver``): multi-turn agent loops, a gateway for agents run elsewhere. Without one, a batch is
    the rollout's batched :meth:`RolloutEngine.generate`. Built by the registered factory from a
    :class:`RolloutDriverContext`."""

    def handles(self, prompts: "DataProto") -> bool:
        """Whether this batch goes through the driver (else through ``generate``). The default: every batch."""
        return True

    @abc.abstractmethod
    def generate(self, prompts: "DataProto", sampling: SamplingParams) -> "DataProto":
        """The same keys and row order as :meth:`RolloutEngine.generate` (``response_mask`` 1 only on sampled
        tokens), plus any non-tensor columns the driver documents; ``meta_info["metrics"]`` may carry
        floats for the step's metrics."""

    def close(self) -> None:
        """Release what the driver holds (threads, servers) when its worker closes. The default: nothing."""
