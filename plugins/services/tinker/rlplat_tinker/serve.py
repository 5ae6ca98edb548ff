"""Starting the service: the workers (one in-process :class:`~rlplat_tinker.worker.TinkerWorker` group), the
service and its HTTP server. ``rlplat serve`` and the tests start it the same way: :func:`start`."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from rlplat.kits.rollout_server import is_loopback
from rlplat_tinker.app import Server
from rlplat_tinker.service import TinkerService

#: a request's datums are one mini-batch, cut into micro-batches by a token budget (their count varies by call)
ENGINE_DEFAULTS = {"dtype": "float32", "grad_clip": None, "weight_decay": 0.0, "ppo_mini_batch_size": None,
                   "use_dynamic_bsz": True, "max_token_len_per_gpu": 16384}


@dataclasses.dataclass
class Running:
    """A started service: :attr:`base_url` for the SDK; :meth:`stop` ends the server, then the workers."""

    server: Server
    service: TinkerService
    group: Any
    state_dir: Path

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def stop(self) -> None:
        try:
            self.server.stop()
        finally:  # the workers (and a Ray cluster) go even when the server's stop fails
            try:
                self.service.shutdown()
            finally:
                self.group.shutdown()

    def __enter__(self) -> "Running":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class RayGroup:
    """Worker processes on a Ray cluster this process started; :meth:`shutdown` ends them and the cluster."""

    def __init__(self, spec: Any, processes: int):
        import ray

        from rlplat import RayWorkerGroup, ResourcePool, start_ray

        self.started = not ray.is_initialized()
        if self.started:
            start_ray(num_cpus=max(processes, 2))
        self.pool = ResourcePool([processes])
        self.group = RayWorkerGroup(self.pool, spec, role="tinker")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)

    def shutdown(self) -> None:
        import ray

        self.group.shutdown()
        self.pool.release()
        if self.started:
            ray.shutdown()


def worker_group(spec: Any, processes: int) -> Any:
    if processes < 1:
        raise ValueError(f"rlplat serve: --processes must be >= 1, got {processes}")
    if processes == 1:
        from rlplat import LocalWorkerGroup

        return LocalWorkerGroup(spec, role="tinker")
    return RayGroup(spec, processes)


def check_build(kind: str, name: str, config: Mapping[str, Any]) -> None:
    """Before anything starts: ``name`` is an installed, usable engine (with the features the service needs) or
    rollout, and ``config`` has only keys its config schema knows (the workers build it on a client's first call,
    which would otherwise be where a typo surfaced)."""
    from rlplat import registry
    from rlplat.config_node import read_config_node, resolve_schema
    from rlplat.registry import EngineRegistry
    from rlplat_tinker.worker import REQUIRED_FEATURES, check_engine_features

    reason = EngineRegistry(kind).why_unavailable(name)
    if reason is not None:
        raise ValueError(f"rlplat serve: --{kind} {name!r}: {reason}")
    entry = registry.entry(kind, name)
    if kind == "engine":  # a factory that is not the engine's class says nothing: the worker checks the engine it builds
        check_engine_features(name, getattr(entry.load(), "features", REQUIRED_FEATURES))
    schema = resolve_schema(entry.config_schema)
    if schema is not None:
        read_config_node(dict(config), schema, f"{kind}")


def special_tokens(model_path: str) -> tuple[int, tuple[int, ...], Optional[str]]:
    """The pad token, the end-of-sequence tokens and the tokenizer's folder (None when the model has none)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    tokenizer_dir, pad = None, getattr(config, "pad_token_id", None)
    if any((Path(model_path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        tokenizer_dir = str(Path(model_path).absolute())
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else pad
    return (pad if pad is not None else (eos_ids[0] if eos_ids else 0)), eos_ids, tokenizer_dir


def start(model_path: str, *, engine: str = "fsdp2", rollout: str = "hf", host: str = "127.0.0.1", port: int = 0,
          keys: Sequence[str] = (), state_dir: Optional[str] = None, base_model: Optional[str] = None,
          engine_config: Optional[Mapping[str, Any]] = None, rollout_config: Optional[Mapping[str, Any]] = None,
          max_snapshots: int = 8, seed: int = 0, processes: int = 1) -> Running:
    """Start the service on ``model_path`` (a local Hugging Face folder). Bound elsewhere than loopback it needs
    ``keys``. ``base_model``: the name clients use (default: the folder's absolute path). ``processes`` above 1:
    that many worker processes on a local Ray cluster, the engine sharded over them (FSDP2 on gloo or NCCL)."""
    from rlplat import WorkerSpec
    from rlplat_tinker.worker import TinkerWorker

    if not Path(model_path).is_dir():
        raise FileNotFoundError(f"rlplat serve: model {model_path!r} is not a local Hugging Face folder")
    if not is_loopback(host) and not keys:
        raise ValueError(f"rlplat serve: binding {host} (not loopback) needs an API key: --api-key or RLPLAT_SERVE_API_KEYS")
    bad = [key for key in keys if not key.startswith("tml-")]
    if bad:
        raise ValueError("rlplat serve: API keys start with 'tml-' (the tinker SDK refuses others before sending them)")
    if not 0 <= port <= 65535:
        raise ValueError(f"rlplat serve: --port must be from 0 (a free one) to 65535, got {port}")
    if max_snapshots < 1:
        raise ValueError(f"rlplat serve: --max-snapshots must be >= 1, got {max_snapshots}")
    model_path = str(Path(model_path).absolute())
    pad, eos, tokenizer_dir = special_tokens(model_path)
    state = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="rlplat-serve-"))
    state.mkdir(parents=True, exist_ok=True)
    worker = {"engine": engine, "rollout": rollout,
              "engine_config": {**ENGINE_DEFAULTS, "seed": seed, **dict(engine_config or {}), "model_path": model_path},
              "rollout_config": {"load_weights": False, **dict(rollout_config or {}), "model_path": model_path}}
    check_build("engine", engine, {**worker["engine_config"], "lora": None})
    check_build("rollout", rollout, worker["rollout_config"])
    group = worker_group(WorkerSpec(TinkerWorker, worker), processes)
    service = TinkerService(group, base_model or model_path, state, tokenizer_dir, pad, eos, max_snapshots)
    try:
        server = Server(service, host, port, keys).start()
    except BaseException as error:
        service.shutdown()
        group.shutdown()
        if isinstance(error, OSError):  # the address is taken, or not this machine's
            raise ValueError(f"rlplat serve: cannot listen on {host}:{port}: {error.strerror or error}") from None
        raise
    return Running(server, service, group, state)
