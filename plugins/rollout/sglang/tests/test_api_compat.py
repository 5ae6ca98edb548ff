"""Every call the sglang rollout makes into SGLang, checked against the installed SGLang (0.5.23).

Nothing here needs a GPU. The plugin's own code paths run against stand-ins that record what they are
given: an ``sglang.Engine`` replacement (hybrid mode) and a ``request_json`` replacement (server mode).
Each recorded call is then checked against the real library: Engine method names and signatures,
``ServerArgs`` fields and command-line flags, the HTTP routes of SGLang's own FastAPI app and the request
classes those routes parse their bodies into.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import inspect
from types import SimpleNamespace

import pytest

sglang = pytest.importorskip(
    "sglang", reason="sglang is not installed in this environment: the API-compatibility tests run in the sglang environment (make test-sglang)"
)

import torch  # noqa: E402

from rlplat.contracts.rollout import SamplingParams  # noqa: E402
from rlplat.testing.rollouts import left_padded_prompts  # noqa: E402
from rlplat.testing.tiny_models import save_tiny_model, tiny_causal_lm  # noqa: E402
from rlplat_rollout_sglang import backends, translate  # noqa: E402
from rlplat_rollout_sglang import rollout as rollout_module  # noqa: E402
from rlplat_rollout_sglang.config import SGLangRolloutConfig  # noqa: E402
from rlplat_rollout_sglang.rollout import SGLangRollout  # noqa: E402

from sglang.srt.constants import GPU_MEMORY_ALL_TYPES, GPU_MEMORY_TYPE_CUDA_GRAPH, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS  # noqa: E402
from sglang.srt.entrypoints.api_contract import generate_contract_error  # noqa: E402
from sglang.srt.entrypoints.engine import Engine  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang.srt.sampling import sampling_params as sglang_sampling  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.utils import MultiprocessingSerializer  # noqa: E402

EOS = 2  # the arithmetic tokenizer's [EOS]
PROMPTS = [[1, 5, 14, 6, 15], [1, 7, 15]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def named_weights():
    return list(tiny_causal_lm(0).state_dict().items())


def fake_output(tokens: list[int], params: dict, index: int) -> dict:
    """What SGLang answers for one request: the tokens ``5, 6, ...`` ended by EOS within the budget."""
    budget = params["max_new_tokens"]
    produced = ([5 + step for step in range(min(index, budget - 1))] + [EOS])[:budget]
    reason = {"type": "stop", "matched": EOS} if produced[-1] == EOS else {"type": "length", "length": budget}
    return {"output_ids": produced, "meta_info": {"id": f"rid-{index}", "finish_reason": reason, "output_token_logprobs": [(-0.5, t, None) for t in produced]}}


def fake_outputs(request: dict) -> list[dict]:
    return [fake_output(tokens, params, index) for index, (tokens, params) in enumerate(zip(request["input_ids"], request["sampling_params"]))]


class RecordingEngine:
    """Stands in for ``sglang.Engine``: records the constructor's keywords and every method call (any
    attribute is callable, so a misspelt method name is recorded and then fails the check). Like SGLang
    0.5.23's scheduler (managers/scheduler_components/weight_updater.py), it loads tensors only inside a
    session opened by ``begin_weight_update`` and closed by ``end_weight_update``."""

    created: list["RecordingEngine"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[str, tuple, dict]] = []
        self.session = False
        RecordingEngine.created.append(self)

    def __getattr__(self, name):
        def method(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "generate":
                return fake_outputs(kwargs)
            if name == "begin_weight_update":
                opened, self.session = not self.session, True
                return opened, "Success" if opened else "a weight-update session is already open"
            if name == "end_weight_update":
                closed, self.session = self.session, False
                return closed, "Success" if closed else "no weight-update session is open"
            if name == "update_weights_from_tensor":
                return (True, "Success") if self.session else (False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
            if name == "flush_cache":
                return SimpleNamespace(success=True, message="")
            if name in ("load_lora_adapter_from_tensors", "unload_lora_adapter"):
                return SimpleNamespace(success=True, error_message=None)
            return None

        return method


@pytest.fixture
def on_gpus(monkeypatch):
    """The rollout takes its GPU path (as with a CUDA build of SGLang), whatever this environment's SGLang runs on."""
    monkeypatch.setattr(rollout_module, "use_cpu_engine", lambda: False)


@pytest.fixture
def hybrid(monkeypatch, model_dir, on_gpus):
    RecordingEngine.created = []
    monkeypatch.setattr(sglang, "Engine", RecordingEngine)
    rollout = SGLangRollout({"model_path": model_dir, "load_weights": False, "enable_deterministic_inference": True})
    yield rollout, RecordingEngine.created[0]


@pytest.fixture
def cpu_hybrid(monkeypatch, model_dir):
    """The rollout on SGLang's CPU engine, over the recording stand-in."""
    RecordingEngine.created = []
    monkeypatch.setattr(rollout_module, "use_cpu_engine", lambda: True)
    monkeypatch.setattr(sglang, "Engine", RecordingEngine)
    rollout = SGLangRollout({"model_path": model_dir, "load_weights": False, "cpu_kv_cache_gib": 0.01})
    yield rollout, RecordingEngine.created[0]


def drive(rollout, named_weights) -> None:
    """Every public path of the rollout, in the order a training step uses them."""
    prompts = left_padded_prompts(PROMPTS, 0)
    rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=3, stop_token_ids=(15,)))
    asyncio.run(rollout.generate_tokens(PROMPTS[0], SamplingParams(max_new_tokens=3, temperature=0.8, top_k=4, top_p=0.9)))
    rollout.update_weights(named_weights)
    rollout.generate(prompts, SamplingParams(greedy=True, max_new_tokens=2))
    rollout.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(prompts, SamplingParams())
    rollout.wake_up_weights()
    with pytest.raises(RuntimeError, match=r"wake_up_kv_cache\(\)"):
        rollout.generate(prompts, SamplingParams())
    rollout.update_weights(named_weights[:3])
    rollout.update_weights(named_weights[3:])
    rollout.wake_up_kv_cache()
    rollout.generate(prompts, SamplingParams(max_new_tokens=3))
    rollout.sleep()
    rollout.wake_up()
    with pytest.raises(RuntimeError, match=r"update_weights\(\)"):
        rollout.generate(prompts, SamplingParams())
    rollout.update_weights(named_weights)
    rollout.close()


# -- hybrid: sglang.Engine ---------------------------------------------------------------------------


def test_every_engine_call_binds_to_the_real_engine_signature(hybrid, named_weights):
    rollout, engine = hybrid
    drive(rollout, named_weights)
    names = set()
    for name, args, kwargs in engine.calls:
        real = getattr(Engine, name, None)
        assert callable(real), f"sglang.Engine has no method {name!r}"
        inspect.signature(real).bind(None, *args, **kwargs)
        names.add(name)
    assert names == {"generate", "begin_weight_update", "update_weights_from_tensor", "end_weight_update", "flush_cache",
                     "release_memory_occupation", "resume_memory_occupation", "shutdown"}


def test_the_engine_keywords_are_server_args_fields_and_build_server_args(hybrid):
    _, engine = hybrid
    fields = set(ServerArgs.__struct_fields__)
    assert not set(engine.kwargs) - fields, f"not ServerArgs fields: {sorted(set(engine.kwargs) - fields)}"
    server_args = ServerArgs(**engine.kwargs)
    assert (server_args.load_format, server_args.skip_tokenizer_init, server_args.enable_memory_saver) == ("dummy", True, True)


def test_the_cpu_engines_keywords_build_server_args_for_the_cpu_device(cpu_hybrid):
    """SGLang's CPU engine: device cpu, its pure-torch attention and sampler, no memory saver, no CUDA graphs,
    and a KV cache of cpu_kv_cache_gib (0.01 GiB of the tiny model's float32... here bfloat16 keys and values:
    2 layers x 2 x 4 heads x 32 x 2 bytes = 1,024 bytes a token: 10,485 tokens)."""
    _, engine = cpu_hybrid
    server_args = ServerArgs(**engine.kwargs)
    assert (server_args.device, server_args.attention_backend, server_args.sampling_backend) == ("cpu", "torch_native", "pytorch")
    assert (server_args.enable_memory_saver, server_args.enable_deterministic_inference) == (False, False)
    assert server_args.disable_decode_cuda_graph and server_args.disable_prefill_cuda_graph
    assert server_args.max_total_tokens == 10_485 and "mem_fraction_static" not in engine.kwargs


def test_on_the_cpu_engine_sleep_and_wake_leave_sglangs_memory_alone(cpu_hybrid, named_weights):
    """The CPU engine has no memory saver: sleep and wake-up keep their state rules, and SGLang is not asked to
    release or resume memory; its weights stay, so a wake-up needs no update before it samples."""
    rollout, engine = cpu_hybrid
    prompts = left_padded_prompts(PROMPTS, 0)
    rollout.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(prompts, SamplingParams())
    rollout.wake_up()
    rollout.generate(prompts, SamplingParams(max_new_tokens=2))
    assert not [name for name, _, _ in engine.calls if name.endswith("memory_occupation")]
    assert rollout.honours_seeds is False


def test_without_deterministic_mode_no_seed_is_sent(cpu_hybrid):
    """SGLang ignores ``sampling_seed`` outside its deterministic mode: the rollout sends none, and says so."""
    rollout, engine = cpu_hybrid
    rollout.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=4, seed=3))
    (_, _, request), = [call for call in engine.calls if call[0] == "generate"]
    assert [params["sampling_seed"] for params in request["sampling_params"]] == [None] * 4 and not rollout.honours_seeds


@pytest.mark.parametrize("setting, message", [
    ({"enable_memory_saver": True}, "torch_memory_saver, which is CUDA-only"),
    ({"enable_deterministic_inference": True}, "samples on CPU are not reproducible from a seed"),
    ({"max_lora_rank": 8}, "its CPU engine cannot serve LoRA adapters"),
])
def test_what_the_cpu_engine_cannot_do_is_refused_before_an_engine_starts(monkeypatch, model_dir, setting, message):
    RecordingEngine.created = []
    monkeypatch.setattr(rollout_module, "use_cpu_engine", lambda: True)
    monkeypatch.setattr(sglang, "Engine", RecordingEngine)
    with pytest.raises(ValueError, match=message):
        SGLangRollout({"model_path": model_dir, **setting})
    assert RecordingEngine.created == []


def test_the_engine_call_sequence_follows_the_staged_wake_up(hybrid, named_weights):
    rollout, engine = hybrid
    drive(rollout, named_weights)
    memory = [(name, kwargs["tags"]) for name, _, kwargs in engine.calls if name.endswith("memory_occupation")]
    all_tags = [GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_CUDA_GRAPH]
    kv_tags = [GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_CUDA_GRAPH]
    assert memory == [
        ("release_memory_occupation", all_tags),
        ("resume_memory_occupation", [GPU_MEMORY_TYPE_WEIGHTS]),
        ("resume_memory_occupation", kv_tags),
        ("release_memory_occupation", all_tags),
        ("resume_memory_occupation", [GPU_MEMORY_TYPE_WEIGHTS]),
        ("resume_memory_occupation", kv_tags),
    ]
    sequence = [name for name, _, _ in engine.calls]
    first_update = sequence.index("update_weights_from_tensor")
    assert sequence[first_update - 1] == "begin_weight_update"
    # the stale radix cache is dropped once, by an update of no tensors, and the session closes before the next generation
    assert sequence[first_update + 1 : first_update + 4] == ["update_weights_from_tensor", "end_weight_update", "generate"]
    flushes = [kwargs for name, _, kwargs in engine.calls if name == "update_weights_from_tensor" and kwargs["flush_cache"]]
    assert flushes == [{"named_tensors": [], "flush_cache": True}]  # the first sync; the next loads asleep, the last precedes close()
    assert sequence.count("begin_weight_update") == sequence.count("end_weight_update") == 3  # one per sync, buckets inside
    assert sequence.count("flush_cache") == 2  # after each wake-up of the KV cache


def test_memory_tags_are_sglangs():
    assert set(translate.ALL_MEMORY_TAGS) == set(GPU_MEMORY_ALL_TYPES)
    assert (translate.WEIGHTS, translate.KV_CACHE, translate.CUDA_GRAPH) == (GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_CUDA_GRAPH)


def test_generate_keywords_build_sglangs_request_and_sampling_params(hybrid, named_weights):
    rollout, engine = hybrid
    drive(rollout, named_weights)
    requests = [kwargs for name, _, kwargs in engine.calls if name == "generate"]
    assert requests
    for request in requests:
        GenerateReqInput(**request).normalize_batch_and_arguments()
        for params in request["sampling_params"]:
            built = sglang_sampling.SamplingParams(**params)
            built.verify(vocab_size=16)
            assert built.n == 1 and built.no_stop_trim and built.stop_token_ids


def test_the_seeded_call_gives_each_sample_its_own_seed(hybrid):
    rollout, engine = hybrid
    rollout.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=4, seed=3))
    (_, _, request), = [call for call in engine.calls if call[0] == "generate"]
    assert [p["sampling_seed"] for p in request["sampling_params"]] == [translate.sample_seed(3, i) for i in range(4)]
    assert request["input_ids"] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]


def test_updated_tensors_survive_sglangs_serializer(hybrid, named_weights):
    rollout, engine = hybrid
    rollout.update_weights(named_weights[:2])
    (_, _, kwargs), = [call for call in engine.calls if call[0] == "update_weights_from_tensor"]
    restored = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(kwargs["named_tensors"]))
    assert [name for name, _ in restored] == [name for name, _ in named_weights[:2]]
    for (_, got), (_, sent) in zip(restored, named_weights[:2]):
        assert got.dtype == torch.bfloat16 and torch.equal(got, sent.to(torch.bfloat16))


def test_the_cuda_ipc_patch_exists():
    from sglang.srt.utils import patch_torch

    assert callable(patch_torch.monkey_patch_torch_reductions) and callable(patch_torch._reduce_tensor_modified)


def test_after_the_cuda_ipc_patch_cpu_tensors_still_pickle():
    from torch.multiprocessing import reductions

    names = ("reduce_tensor", "rebuild_cuda_tensor", "_reduce_tensor_original", "_rebuild_cuda_tensor_original")
    saved = {name: getattr(reductions, name) for name in names if hasattr(reductions, name)}
    try:
        backends.share_by_device_uuid([("w", SimpleNamespace(is_cuda=True))])  # as when a CUDA bucket is about to travel
        assert reductions._reduce_tensor_original is saved["reduce_tensor"]  # SGLang's patch is in place...
        restored = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize([("cpu", torch.ones(3))]))
        assert torch.equal(restored[0][1], torch.ones(3))  # ...and CPU tensors (SGLang's own patch breaks them) still travel
    finally:
        for name in names:
            if name in saved:
                setattr(reductions, name, saved[name])
            elif hasattr(reductions, name):
                delattr(reductions, name)
        reductions.init_reductions()


def test_top_k_all_is_sglangs_constant():
    assert translate.TOP_K_ALL == sglang_sampling.TOP_K_ALL


# -- ServerArgs and the command line -----------------------------------------------------------------


FULL_CONFIG = dict(
    mode="server", load_weights=False, dtype="float16", tp_size=2, mem_fraction_static=0.4, context_length=512, max_running_requests=64,
    disable_radix_cache=True, disable_cuda_graph=True, enable_deterministic_inference=True, seed=11,
    engine_kwargs={"attention_backend": "triton", "chunked_prefill_size": 256},
)


def test_every_server_args_keyword_is_a_real_field():
    kwargs = translate.server_args_kwargs(SGLangRolloutConfig(model_path="/m", **FULL_CONFIG))
    assert not set(kwargs) - set(ServerArgs.__struct_fields__)
    ServerArgs(**kwargs)


@pytest.mark.parametrize("cpu", [False, True], ids=["gpu", "cpu-engine"])
def test_server_argv_parses_with_sglangs_own_parser_to_the_same_values(cpu):
    settings = {**FULL_CONFIG, "tp_size": 1, "enable_deterministic_inference": False} if cpu else FULL_CONFIG
    kwargs = translate.server_args_kwargs(SGLangRolloutConfig(model_path="/m", **settings), cpu, 4096 if cpu else None)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(translate.server_argv(kwargs, "127.0.0.1", 30123))
    for key, value in kwargs.items():
        assert getattr(parsed, key) == value, key
    assert (parsed.host, parsed.port) == ("127.0.0.1", 30123)
    assert (parsed.device == "cpu") == cpu


def test_the_server_module_exists():
    assert importlib.util.find_spec("sglang.launch_server") is not None


# -- server mode: HTTP routes and request bodies -----------------------------------------------------


@pytest.fixture(scope="module")
def http_routes():
    from fastapi.routing import APIRoute

    from sglang.srt.entrypoints.http_server import app

    return [route for route in app.routes if isinstance(route, APIRoute)]


@pytest.fixture
def server(monkeypatch, model_dir, on_gpus):
    calls = []

    def request_json(url, payload=None, *, method=None, timeout=600.0):
        path = url.split("://", 1)[1].split("/", 1)[1]
        calls.append(("/" + path, payload, method or ("GET" if payload is None else "POST")))
        if path == "generate":
            return fake_outputs(payload)
        if path in ("update_weights_from_tensor", "begin_weight_update", "end_weight_update"):
            return {"success": True, "message": "Success"}
        if path == "flush_cache":
            return "Cache flushed."
        if path in ("load_lora_adapter_from_tensors", "unload_lora_adapter"):
            return {"success": True, "error_message": None}
        return None

    monkeypatch.setattr(backends, "request_json", request_json)
    rollout = SGLangRollout({"mode": "server", "server_url": "http://127.0.0.1:9/", "model_path": model_dir, "tp_size": 2})
    return rollout, calls


def body_fields(cls) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(cls.__struct_fields__)


def test_every_route_exists_with_its_method_and_every_body_validates(server, named_weights, http_routes):
    import pydantic

    rollout, calls = server
    drive(rollout, named_weights)
    paths = set()
    for path, payload, method in calls:
        routes = [route for route in http_routes if route.path == path and method in route.methods]
        assert routes, f"sglang's HTTP server has no {method} {path}"
        body = routes[0].dependant.body_params
        if payload is None:
            assert all(not param.required for param in body), f"{path} needs a body"
            paths.add(path)
            continue
        (param,) = body
        cls = param.field_info.annotation
        assert not set(payload) - body_fields(cls), f"{path}: {sorted(set(payload) - body_fields(cls))} are not fields of {cls.__name__}"
        pydantic.TypeAdapter(cls).validate_python(payload)
        paths.add(path)
    assert paths == {"/generate", "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update", "/flush_cache",
                     "/release_memory_occupation", "/resume_memory_occupation"}


def test_the_health_route_answers_get(http_routes):
    assert any(route.path == backends.HEALTH_PATH and "GET" in route.methods for route in http_routes)


def test_generate_bodies_pass_sglangs_json_contract(server, named_weights):
    rollout, calls = server
    drive(rollout, named_weights)
    bodies = [payload for path, payload, _ in calls if path == "/generate"]
    assert bodies
    for body in bodies:
        assert generate_contract_error(body) is None


def test_weight_bodies_decode_to_the_bucket_once_per_tp_rank(server, named_weights, http_routes):
    import pydantic

    rollout, calls = server
    rollout.update_weights(named_weights[:2])
    (route,) = [r for r in http_routes if r.path == "/update_weights_from_tensor"]
    cls = route.dependant.body_params[0].field_info.annotation
    (payload,) = [payload for path, payload, _ in calls if path == "/update_weights_from_tensor"]
    request = pydantic.TypeAdapter(cls).validate_python(payload)
    assert len(request.serialized_named_tensors) == 2 and request.flush_cache is False
    for raw in request.serialized_named_tensors:
        restored = MultiprocessingSerializer.deserialize(raw)
        assert [name for name, _ in restored] == [name for name, _ in named_weights[:2]]
        assert torch.equal(restored[0][1], named_weights[0][1].to(torch.bfloat16))


def test_memory_bodies_carry_sglangs_tags(server, named_weights):
    rollout, calls = server
    rollout.sleep()
    rollout.wake_up()
    tags = [payload["tags"] for path, payload, _ in calls if path.endswith("memory_occupation")]
    assert tags == [list(translate.ALL_MEMORY_TAGS), [GPU_MEMORY_TYPE_WEIGHTS], list(translate.KV_CACHE_TAGS)]
    assert all(set(t) <= set(GPU_MEMORY_ALL_TYPES) for t in tags)


def test_a_run_on_cpus_is_refused_at_config_validation_only_with_a_cuda_build(monkeypatch):
    """``needs_gpu`` follows the installed SGLang: this environment's runs on CPUs; a CUDA build (here said by
    ``SGLANG_USE_CPU_ENGINE=0``) needs ``cluster.use_gpu=true``."""
    from rlplat_demo import overrides as demo_overrides
    from rlplat.config import ConfigError, load_config

    config = load_config(None, demo_overrides(), algo="grpo", engine="fsdp2", rollout="sglang")
    assert config.rollout.name == "sglang" and not config.cluster.use_gpu
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "0")
    with pytest.raises(ConfigError, match=r"rollout 'sglang' runs on GPUs only: set cluster.use_gpu=true"):
        load_config(None, demo_overrides(), algo="grpo", engine="fsdp2", rollout="sglang")


# -- LoRA adapters -------------------------------------------------------------------------------------


def peft_adapter(seed: int = 1):
    """peft's LoRA on the tiny model, lora_B random (peft starts it at zero): (config dict, tensors named
    as peft's full state dict names them, with the adapter name '.default.')."""
    import peft

    model = peft.get_peft_model(tiny_causal_lm(0), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    tensors = [(name, tensor.clone()) for name, tensor in model.state_dict().items() if ".lora_" in name]
    return model.peft_config["default"].to_dict(), tensors


def drive_adapters(rollout, named_weights) -> None:
    """Two adapters in turn, generation with each, then full weights (which drop the adapter)."""
    prompts = left_padded_prompts(PROMPTS, 0)
    for seed in (1, 2):
        rollout.load_adapter(*peft_adapter(seed))
        rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=3))
    rollout.update_weights(named_weights)
    rollout.generate(prompts, SamplingParams(max_new_tokens=2))


@pytest.fixture
def lora_hybrid(monkeypatch, model_dir, on_gpus):
    RecordingEngine.created = []
    monkeypatch.setattr(sglang, "Engine", RecordingEngine)
    rollout = SGLangRollout({"model_path": model_dir, "load_weights": False, "max_lora_rank": 8})
    yield rollout, RecordingEngine.created[0]


def test_the_lora_server_args_build_server_args(lora_hybrid):
    _, engine = lora_hybrid
    server_args = ServerArgs(**engine.kwargs)
    assert (server_args.enable_lora, server_args.max_lora_rank) == (True, 8)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    config = SGLangRolloutConfig(model_path="/m", mode="server", max_lora_rank=8, lora_target_modules=("q_proj", "v_proj"))
    parsed = parser.parse_args(translate.server_argv(translate.server_args_kwargs(config), "127.0.0.1", 30123))
    assert (parsed.enable_lora, parsed.max_lora_rank, set(parsed.lora_target_modules)) == (True, 8, {"q_proj", "v_proj"})


def test_every_lora_call_binds_and_each_request_names_the_adapter_loaded(lora_hybrid, named_weights):
    rollout, engine = lora_hybrid
    drive_adapters(rollout, named_weights)
    for name, args, kwargs in engine.calls:
        inspect.signature(getattr(Engine, name)).bind(None, *args, **kwargs)
    sequence = [(name, kwargs.get("lora_name") or kwargs.get("lora_path")) for name, _, kwargs in engine.calls
                if name in ("load_lora_adapter_from_tensors", "unload_lora_adapter", "generate")]
    assert sequence == [
        ("load_lora_adapter_from_tensors", "rlplat-adapter-1"), ("generate", "rlplat-adapter-1"),
        ("load_lora_adapter_from_tensors", "rlplat-adapter-2"), ("unload_lora_adapter", "rlplat-adapter-1"),
        ("generate", "rlplat-adapter-2"), ("unload_lora_adapter", "rlplat-adapter-2"), ("generate", None)]
    for name, _, kwargs in engine.calls:
        if name == "generate":
            GenerateReqInput(**kwargs).normalize_batch_and_arguments()


def test_the_adapter_reaches_sglang_as_its_lora_config_and_layer_tensors_read_it(lora_hybrid):
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.lora.utils import get_normalized_target_modules
    from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
    from sglang.srt.layers.utils import get_layer_id

    rollout, engine = lora_hybrid
    config, tensors = peft_adapter()
    rollout.load_adapter(config, tensors)
    (_, _, kwargs), = [call for call in engine.calls if call[0] == "load_lora_adapter_from_tensors"]
    request = LoadLoRAAdapterFromTensorsReqInput(lora_name=kwargs["lora_name"], config_dict=kwargs["config_dict"],
                                                 serialized_named_tensors=[MultiprocessingSerializer.serialize(kwargs["tensors"])])
    lora_config = LoRAConfig.from_dict(request.config_dict, base_vocab_size=16)
    assert (lora_config.r, lora_config.lora_alpha, lora_config.use_dora) == (4, 8, False)
    assert get_normalized_target_modules(lora_config.target_modules) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    restored = MultiprocessingSerializer.deserialize(request.serialized_named_tensors[0])
    given = {name.replace(".default.", "."): tensor for name, tensor in tensors}
    assert sorted(restored) == sorted(given)
    for name, tensor in restored.items():
        assert get_layer_id(name) in (0, 1) and name.endswith((".lora_A.weight", ".lora_B.weight"))
        assert torch.equal(tensor, given[name])


def test_the_lora_routes_exist_and_take_the_bodies_sent(monkeypatch, model_dir, named_weights, http_routes, on_gpus):
    import pydantic

    calls = []

    def request_json(url, payload=None, *, method=None, timeout=600.0):
        path = url.split("://", 1)[1].split("/", 1)[1]
        calls.append(("/" + path, payload, method or ("GET" if payload is None else "POST")))
        if path == "generate":
            return fake_outputs(payload)
        if path == "flush_cache":
            return "Cache flushed."
        return {"success": True, "message": "Success", "error_message": None}

    monkeypatch.setattr(backends, "request_json", request_json)
    rollout = SGLangRollout({"mode": "server", "server_url": "http://127.0.0.1:9/", "model_path": model_dir, "tp_size": 2, "max_lora_rank": 8})
    drive_adapters(rollout, named_weights)
    for path, payload, method in calls:
        (route,) = [route for route in http_routes if route.path == path and method in route.methods]
        if payload is not None:
            cls = route.dependant.body_params[0].field_info.annotation
            assert not set(payload) - body_fields(cls), path
            request = pydantic.TypeAdapter(cls).validate_python(payload)
            if path == "/load_lora_adapter_from_tensors":
                assert len(request.serialized_named_tensors) == 2  # one per TP rank
                assert len(MultiprocessingSerializer.deserialize(request.serialized_named_tensors[0])) == 28
    paths = [path for path, _, _ in calls if "lora" in path or path == "/generate"]
    assert paths == ["/load_lora_adapter_from_tensors", "/generate", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
                     "/generate", "/unload_lora_adapter", "/generate"]
    bodies = [payload for path, payload, _ in calls if path == "/generate"]
    assert [body.get("lora_path") for body in bodies] == ["rlplat-adapter-1", "rlplat-adapter-2", None]
    assert all(generate_contract_error(body) is None for body in bodies)


def test_load_adapter_without_sglangs_lora_support_or_above_its_rank_is_refused(hybrid, lora_hybrid):
    config, tensors = peft_adapter()
    with pytest.raises(RuntimeError, match="set rollout.config.max_lora_rank"):
        hybrid[0].load_adapter(config, tensors)
    with pytest.raises(ValueError, match=r"rank r=16 is not in \[1, rollout.config.max_lora_rank=8\]"):
        lora_hybrid[0].load_adapter({**config, "r": 16}, tensors)
