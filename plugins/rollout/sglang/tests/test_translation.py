"""The sglang rollout's translation of rlplat settings and SGLang outputs; needs no sglang."""

from __future__ import annotations

import pytest

from rlplat.config_node import read_config_node

from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat_rollout_sglang.config import SGLangRolloutConfig
from rlplat_rollout_sglang.translate import (
    TOP_K_ALL,
    adapter_tensors,
    cpu_engine_problems,
    generate_request,
    json_value,
    kv_cache_tokens,
    per_sample_params,
    sample_from_output,
    sample_seed,
    samples_from_outputs,
    sampling_params,
    server_args_kwargs,
    server_argv,
)


def output(tokens, logprobs, reason):
    """An SGLang generate result as ``Engine.generate`` returns it (``(logprob, id, text)`` triples)."""
    return {"output_ids": tokens, "meta_info": {"id": "r0", "finish_reason": reason, "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, tokens)]}}


# -- sampling ----------------------------------------------------------------------------------------


def test_every_sampling_field_is_translated_to_sglang_names():
    sampling = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=17, stop_token_ids=(9, 4), seed=5)
    assert sampling_params(sampling) == {
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 17,
        "min_new_tokens": 0,
        "stop_token_ids": [4, 9],
        "ignore_eos": False,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "sampling_seed": 5,
    }


def test_top_k_zero_is_sglangs_whole_vocabulary_value():
    assert TOP_K_ALL == 1 << 30  # sglang/srt/sampling/sampling_params.py
    assert sampling_params(SamplingParams(top_k=0))["top_k"] == TOP_K_ALL


def test_greedy_is_temperature_zero_with_the_filters_off():
    params = sampling_params(SamplingParams(greedy=True, temperature=0.3, top_p=0.5, top_k=7))
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.0, 1.0, TOP_K_ALL)


def test_eos_ids_join_the_call_stop_ids_without_duplicates():
    assert sampling_params(SamplingParams(stop_token_ids=(7, 2)), eos_token_ids=(2, 3))["stop_token_ids"] == [2, 3, 7]


def test_no_stop_ids_at_all_is_none():
    assert sampling_params(SamplingParams())["stop_token_ids"] is None


def test_no_seed_is_none():
    assert sampling_params(SamplingParams())["sampling_seed"] is None


def test_per_sample_params_have_n_one_and_their_own_seed():
    params = per_sample_params(SamplingParams(n=2, seed=1), 4, (2,), [11, 12, 13, 14])
    assert [p["n"] for p in params] == [1, 1, 1, 1]
    assert [p["sampling_seed"] for p in params] == [11, 12, 13, 14]
    assert all(p["stop_token_ids"] == [2] for p in params)


def test_sample_seeds_differ_per_index_and_stay_in_sglangs_range():
    seeds = [sample_seed(7, index) for index in range(4)]
    assert seeds == [7 * 1_000_003, 7 * 1_000_003 + 1, 7 * 1_000_003 + 2, 7 * 1_000_003 + 3]
    assert 0 <= sample_seed(2**62, 5) < 2**63


def test_generate_request_is_a_batch_with_log_probs():
    request = generate_request([[1, 2], (3,)], [{"n": 1}, {"n": 1}])
    assert request == {"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 1}, {"n": 1}], "return_logprob": True}
    with pytest.raises(ValueError, match="2 prompts but 1 sampling"):
        generate_request([[1], [2]], [{}])


# -- engine arguments --------------------------------------------------------------------------------


def test_server_args_for_training_use_dummy_weights_and_the_memory_saver():
    kwargs = server_args_kwargs(SGLangRolloutConfig(model_path="/m", load_weights=False))
    assert kwargs == {
        "model_path": "/m",
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "tp_size": 1,
        "mem_fraction_static": 0.5,
        "enable_memory_saver": True,
        "disable_radix_cache": False,
        "enable_deterministic_inference": False,
        "random_seed": 0,
    }


def test_disable_cuda_graph_sets_both_phase_switches_and_engine_kwargs_win():
    config = SGLangRolloutConfig(model_path="/m", disable_cuda_graph=True, context_length=64, engine_kwargs={"dtype": "float16", "attention_backend": "triton"})
    kwargs = server_args_kwargs(config)
    assert kwargs["disable_decode_cuda_graph"] and kwargs["disable_prefill_cuda_graph"]
    assert (kwargs["load_format"], kwargs["context_length"], kwargs["dtype"], kwargs["attention_backend"]) == ("auto", 64, "float16", "triton")


def test_server_argv_writes_flags_and_leaves_false_booleans_out():
    argv = server_argv(server_args_kwargs(SGLangRolloutConfig(model_path="/m", enable_memory_saver=False)), "127.0.0.1", 30001)
    assert argv[:2] == ["--model-path", "/m"]
    assert "--skip-tokenizer-init" in argv and "--enable-memory-saver" not in argv
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "30001"]


def test_the_cpu_engine_runs_on_the_cpu_device_with_its_pure_torch_kernels_and_a_kv_cache_in_tokens():
    """SGLang's CPU engine: device cpu, ``torch_native`` attention, the ``pytorch`` sampler, no CUDA graphs, no
    memory saver, and ``max_total_tokens`` instead of a fraction of free memory; engine_kwargs still win."""
    kwargs = server_args_kwargs(SGLangRolloutConfig(model_path="/m", engine_kwargs={"chunked_prefill_size": 256}), cpu=True, kv_cache_tokens=4096)
    assert {key: kwargs[key] for key in ("device", "attention_backend", "sampling_backend", "max_total_tokens", "enable_memory_saver")} == {
        "device": "cpu", "attention_backend": "torch_native", "sampling_backend": "pytorch", "max_total_tokens": 4096, "enable_memory_saver": False}
    assert kwargs["disable_decode_cuda_graph"] and kwargs["disable_prefill_cuda_graph"] and "mem_fraction_static" not in kwargs
    assert kwargs["chunked_prefill_size"] == 256
    assert server_args_kwargs(SGLangRolloutConfig(model_path="/m", engine_kwargs={"max_total_tokens": 64}), cpu=True, kv_cache_tokens=4096)["max_total_tokens"] == 64


def test_the_cpu_kv_cache_in_tokens_is_its_size_over_the_models_bytes_a_token():
    """0.5B Qwen2 (24 layers, 2 KV heads of 64): 12,288 bytes a token in bfloat16, 24,576 in float32."""
    qwen = {"vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2}
    assert kv_cache_tokens(SGLangRolloutConfig(model_path="/m", cpu_kv_cache_gib=1.0), qwen) == 2**30 // 12_288
    assert kv_cache_tokens(SGLangRolloutConfig(model_path="/m", cpu_kv_cache_gib=1.0, dtype="float32"), qwen) == 2**30 // 24_576
    assert kv_cache_tokens(SGLangRolloutConfig(model_path="/m", dtype="auto"), {**qwen, "torch_dtype": "float32"}) == 2**30 // 24_576


def test_what_the_cpu_engine_cannot_do_is_named():
    assert cpu_engine_problems(SGLangRolloutConfig(model_path="/m")) == []
    problems = cpu_engine_problems(SGLangRolloutConfig(model_path="/m", mode="server", enable_memory_saver=True,
                                                       enable_deterministic_inference=True, tp_size=2, max_lora_rank=8))
    assert len(problems) == 4 and "CUDA-only" in problems[0] and "not reproducible from a seed" in problems[1] and "tp_size=2" in problems[2]
    assert "cannot serve LoRA adapters" in problems[3] and "actor.lora.sync=merged" in problems[3]


# -- configuration errors ----------------------------------------------------------------------------


# -- LoRA adapters -----------------------------------------------------------------------------------


def test_a_max_lora_rank_turns_on_sglangs_lora_for_the_target_modules():
    kwargs = server_args_kwargs(SGLangRolloutConfig(model_path="/m", max_lora_rank=8, lora_target_modules=("q_proj", "v_proj")))
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["lora_target_modules"]) == (True, 8, ["q_proj", "v_proj"])
    assert server_args_kwargs(SGLangRolloutConfig(model_path="/m", max_lora_rank=8))["lora_target_modules"] == ["all"]
    assert "enable_lora" not in server_args_kwargs(SGLangRolloutConfig(model_path="/m"))  # 0: off
    argv = server_argv(server_args_kwargs(SGLangRolloutConfig(model_path="/m", mode="server", max_lora_rank=8)), "127.0.0.1", 30000)
    assert "--enable-lora" in argv and argv[argv.index("--lora-target-modules") + 1] == "all"


def test_the_loaded_adapter_is_named_by_every_request():
    request = generate_request([[1, 2], [3]], [{"n": 1}, {"n": 1}], adapter="rlplat-adapter-2")
    assert request["lora_path"] == "rlplat-adapter-2"
    assert "lora_path" not in generate_request([[1]], [{"n": 1}])


def test_adapter_tensors_drop_peft_adapter_names_and_the_config_becomes_json():
    import torch

    tensors = adapter_tensors([("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", torch.ones(2, 3)),
                               ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.ones(4, 2))])
    assert sorted(tensors) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    config = json_value({"r": 2, "target_modules": {"v_proj", "q_proj"}, "peft_type": type("E", (), {"value": "LORA"})()})
    assert config == {"r": 2, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    with pytest.raises(ValueError, match="no adapter tensors"):
        adapter_tensors([])


def test_bad_lora_settings_are_named():
    with pytest.raises(ValueError, match=r"max_lora_rank must be an int >= 0.*lora_target_modules is empty"):
        read_config_node({"model_path": "/m", "max_lora_rank": -1, "lora_target_modules": []}, SGLangRolloutConfig)


def test_an_unknown_key_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown config key 'SGLangRolloutConfig.gpu_memory_utilization'.*mem_fraction_static"):
        read_config_node({"model_path": "/m", "gpu_memory_utilization": 0.5}, SGLangRolloutConfig)


def test_a_bad_mode_lists_the_modes():
    with pytest.raises(ValueError, match=r"mode must be one of \('hybrid', 'server'\), got 'colocated'"):
        read_config_node({"model_path": "/m", "mode": "colocated"}, SGLangRolloutConfig)


def test_model_path_is_required_unless_a_server_url_is_given():
    with pytest.raises(ValueError, match="model_path is required"):
        read_config_node({}, SGLangRolloutConfig)
    assert read_config_node({"mode": "server", "server_url": "http://h:1"}, SGLangRolloutConfig).server_url == "http://h:1"


def test_server_url_needs_server_mode_and_bad_numbers_are_named():
    with pytest.raises(ValueError, match="server_url is a server-mode key") as error:
        read_config_node({"model_path": "/m", "server_url": "http://h:1", "tp_size": 0, "mem_fraction_static": 1.5}, SGLangRolloutConfig)
    assert "tp_size must be >= 1, got 0" in str(error.value) and "mem_fraction_static must be in (0, 1], got 1.5" in str(error.value)


def test_lists_become_tuples_for_eos_ids():
    assert read_config_node({"model_path": "/m", "eos_token_ids": [2, 3]}, SGLangRolloutConfig).eos_token_ids == (2, 3)


# -- outputs -----------------------------------------------------------------------------------------


def test_a_stopped_output_keeps_its_stop_token_and_log_probs_in_order():
    sample = sample_from_output(output([5, 6, 2], [-0.5, -1.0, -0.25], {"type": "stop", "matched": 2}), {2}, 8)
    assert sample == TokenOutput([5, 6, 2], [-0.5, -1.0, -0.25], "stop")


def test_a_length_output_and_json_lists_are_read_alike():
    answer = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2}, "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]]}}
    assert sample_from_output(answer, {2}, 2) == TokenOutput([5, 6], [-0.1, -0.2], "length")


def test_an_abort_is_an_error_with_sglangs_message():
    with pytest.raises(RuntimeError, match="sglang aborted request 'r0': KV cache full"):
        sample_from_output(output([5], [-0.1], {"type": "abort", "message": "KV cache full"}), {2}, 8)


def test_log_probs_that_do_not_match_the_tokens_are_an_error():
    with pytest.raises(RuntimeError, match="1 output_token_logprobs for 2 tokens"):
        sample_from_output({"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.1, 5, None)]}}, {2}, 2)
    with pytest.raises(RuntimeError, match="entry 1 is for token 7, but output token 1 is 6"):
        sample_from_output({"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.1, 5, None), (-0.2, 7, None)]}}, {2}, 2)


def test_batched_outputs_are_counted():
    outputs = [output([2], [-0.3], {"type": "stop", "matched": 2}), output([4, 2], [-0.1, -0.2], {"type": "stop", "matched": 2})]
    assert [s.token_ids for s in samples_from_outputs(outputs, 2, {2}, 4)] == [[2], [4, 2]]
    with pytest.raises(RuntimeError, match="sglang returned 2 results for 3 requests"):
        samples_from_outputs(outputs, 3, {2}, 4)


# -- rlplat plan -----------------------------------------------------------------------------------------


QWEN2 = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}


def memory_context(device: str, memory: int | None = None):
    from rlplat.contracts.memory import MemoryContext

    return MemoryContext(role="rollout", processes=1, device=device, device_memory=memory, prompt_length=16, response_length=16,
                         sequences_per_process=8, free_between_phases=True)


def test_on_cpu_the_plan_counts_a_kv_cache_of_cpu_kv_cache_gib_held_in_every_phase():
    from rlplat_rollout_sglang.memory import estimate

    plan = estimate({"model_path": "/m", "dtype": "float32", "cpu_kv_cache_gib": 0.5}, QWEN2, memory_context("cpu"))
    kv = next(item for item in plan.items if item.name == "KV cache")
    assert kv.bytes == 1 << 29 and kv.calls == ("resident",) and not plan.problems
    tiny = estimate({"model_path": "/m", "dtype": "float32", "cpu_kv_cache_gib": 1e-6}, QWEN2, memory_context("cpu"))
    assert "sglang: rollout.config.cpu_kv_cache_gib=1e-06 holds" in tiny.problems[0] and "less than one sequence (32)" in tiny.problems[0]


def test_on_gpus_the_plan_takes_mem_fraction_static_and_frees_it_between_phases_with_the_memory_saver():
    from rlplat_rollout_sglang.memory import estimate

    plan = estimate({"model_path": "/m", "dtype": "bfloat16", "mem_fraction_static": 0.5}, QWEN2, memory_context("cuda", 80 << 30))
    kv = next(item for item in plan.items if item.name == "KV cache")
    assert kv.calls == ("generate", "wake_up") and "mem_fraction_static=0.5" in kv.detail
    kept = estimate({"model_path": "/m", "enable_memory_saver": False}, QWEN2, memory_context("cuda", 80 << 30))
    assert next(item for item in kept.items if item.name == "KV cache").calls == ("resident",)
