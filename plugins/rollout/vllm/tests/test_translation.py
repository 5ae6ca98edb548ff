"""rlplat's sampling and config in vLLM's terms, and vLLM's outputs back; needs no vllm (runs in `make test`)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from rlplat.config_node import read_config_node

from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat_rollout_vllm.config import VLLMRolloutConfig
from rlplat_rollout_vllm.translate import (
    cache_salt,
    completion_payload,
    engine_kwargs,
    generate_payload,
    packed_update_info,
    repeat_greedy,
    sample_from_completion,
    sample_from_generate_response,
    samples_from_completion_response,
    sampling_kwargs,
    score_kwargs,
    score_payload,
    scored_response,
    scoring_limits_problem,
    scoring_rows,
    ScoringRow,
    server_arguments,
    token_finish_reason,
    versions_from_spans,
    weight_path,
    write_adapter,
)


def logprob_positions(pairs):
    """vLLM's per-position ``{token_id: Logprob}``: the sampled token plus one other candidate."""
    return [{token: types.SimpleNamespace(logprob=value), token + 1: types.SimpleNamespace(logprob=-9.0)} for token, value in pairs]


class TestSamplingKwargs:
    def test_every_field_is_translated(self):
        sampling = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33, stop_token_ids=(9, 3), seed=5)
        assert sampling_kwargs(sampling) == {
            "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 33, "min_tokens": 0,
            "stop_token_ids": [3, 9], "ignore_eos": True, "seed": 5 * 1_000_003, "logprobs": 0, "detokenize": False,
        }

    def test_each_request_of_a_seeded_call_gets_seeds_of_its_own(self):
        # vLLM seeds the n samples of a request seed + i: requests spaced by n give every row its own seed
        sampling = SamplingParams(n=4, seed=5)
        seeds = [sampling_kwargs(sampling, first_row=prompt * 4)["seed"] + i for prompt in range(3) for i in range(4)]
        assert seeds == [5 * 1_000_003 + row for row in range(12)]
        assert sampling_kwargs(SamplingParams(seed=5))["seed"] == seeds[0]  # generate_tokens samples as row 0
        assert sampling_kwargs(SamplingParams(seed=2**62))["seed"] < 2**63  # vLLM takes int64 seeds

    def test_responses_end_at_the_rollouts_eos_ids_not_at_vllms_own(self):
        kwargs = sampling_kwargs(SamplingParams(stop_token_ids=(9,)), eos_token_ids=(5,))
        assert kwargs["ignore_eos"] is True and kwargs["stop_token_ids"] == [5, 9]

    def test_greedy_is_temperature_zero_with_the_filters_off_and_one_sample(self):
        kwargs = sampling_kwargs(SamplingParams(n=3, greedy=True, temperature=0.3, top_p=0.5, top_k=7))
        assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"], kwargs["n"]) == (0.0, 1.0, 0, 1)

    def test_the_one_greedy_sample_is_repeated_n_times(self):
        samples = [TokenOutput([1], [-0.5], "stop"), TokenOutput([2], [-0.25], "stop")]
        assert repeat_greedy(samples, SamplingParams(n=2, greedy=True)) == [samples[0], samples[0], samples[1], samples[1]]
        assert repeat_greedy(samples, SamplingParams(n=2)) == samples

    def test_top_k_zero_means_off_in_both(self):
        assert sampling_kwargs(SamplingParams(top_k=0))["top_k"] == 0

    def test_configured_eos_ids_join_the_stop_ids_once(self):
        assert sampling_kwargs(SamplingParams(stop_token_ids=(4, 2)), eos_token_ids=(2, 11))["stop_token_ids"] == [2, 4, 11]

    def test_no_seed_stays_none(self):
        assert sampling_kwargs(SamplingParams())["seed"] is None


class TestEngineKwargs:
    def test_training_starts_from_dummy_weights_and_asks_for_processed_log_probs(self):
        kwargs = engine_kwargs(VLLMRolloutConfig(model_path="/models/tiny", load_weights=False))
        assert kwargs["model"] == "/models/tiny"
        assert kwargs["load_format"] == "dummy"
        assert kwargs["logprobs_mode"] == "processed_logprobs"
        assert kwargs["weight_transfer_config"] == {"backend": "ipc"}
        assert kwargs["enable_sleep_mode"] is True
        assert kwargs["generation_config"] == "vllm"  # no sampling defaults from the model's generation_config.json

    def test_unset_options_are_left_to_vllm_and_engine_kwargs_win(self):
        config = VLLMRolloutConfig(model_path="/m", max_model_len=None, engine_kwargs={"max_logprobs": 5, "enforce_eager": True})
        kwargs = engine_kwargs(config)
        assert "max_model_len" not in kwargs and "max_num_seqs" not in kwargs
        assert kwargs["max_logprobs"] == 5 and kwargs["enforce_eager"] is True
        assert engine_kwargs(VLLMRolloutConfig(model_path="/m"))["load_format"] == "auto"

    def test_on_vllms_cpu_platform_sleep_is_off_the_kv_cache_is_in_gib_and_weights_load_through_the_extension(self):
        kwargs = engine_kwargs(VLLMRolloutConfig(model_path="/m", cpu_kv_cache_gib=0.5), cpu=True)
        assert kwargs["enable_sleep_mode"] is False and kwargs["kv_cache_memory_bytes"] == 1 << 29
        assert kwargs["worker_extension_cls"] == "rlplat_rollout_vllm.worker_extension.WeightLoader"
        assert kwargs["weight_transfer_config"] == {"backend": "ipc"}  # the update bracket's engine
        # prompts prefilled whole (a split seeded prompt fails on CPU); the step budget holds the longest one
        assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 8192
        long = engine_kwargs(VLLMRolloutConfig(model_path="/m", max_model_len=20000), cpu=True)
        assert long["max_num_batched_tokens"] == 20000
        assert engine_kwargs(VLLMRolloutConfig(model_path="/m", max_num_batched_tokens=512), cpu=True)["max_num_batched_tokens"] == 512
        gpu = engine_kwargs(VLLMRolloutConfig(model_path="/m"))
        assert "worker_extension_cls" not in gpu and "kv_cache_memory_bytes" not in gpu
        assert engine_kwargs(VLLMRolloutConfig(model_path="/m", weight_transfer_backend="load"))["worker_extension_cls"]

    def test_the_ipc_path_is_refused_on_the_cpu_platform_and_auto_picks_per_platform(self):
        assert (weight_path(VLLMRolloutConfig(model_path="/m"), cpu=True), weight_path(VLLMRolloutConfig(model_path="/m"), cpu=False)) == ("load", "ipc")
        with pytest.raises(ValueError, match="needs CUDA"):
            engine_kwargs(VLLMRolloutConfig(model_path="/m", weight_transfer_backend="ipc"), cpu=True)
        with pytest.raises(ValueError, match="weight_transfer_backend must be one of"):
            read_config_node({"model_path": "/m", "weight_transfer_backend": "nccl"}, VLLMRolloutConfig)

    def test_server_arguments_put_the_model_first_and_write_every_flag(self):
        config = VLLMRolloutConfig(model_path="/m", mode="server", enable_prefix_caching=False, max_model_len=512)
        argv = server_arguments(config, "127.0.0.1", 8123)
        assert argv[:2] == ["serve", "/m"]
        assert "--no-enable-prefix-caching" in argv and "--enable-sleep-mode" in argv
        assert argv[argv.index("--max-model-len") + 1] == "512"
        assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "ipc"}
        assert argv[-4:] == ["--host", "127.0.0.1", "--port", "8123"]


class TestLoraSupport:
    def test_a_max_lora_rank_turns_on_vllms_lora_for_one_adapter(self):
        kwargs = engine_kwargs(VLLMRolloutConfig(model_path="/m", max_lora_rank=8))
        assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (True, 8, 1)
        assert "enable_lora" not in engine_kwargs(VLLMRolloutConfig(model_path="/m"))  # 0: off

    def test_the_server_is_started_with_lora_on(self):
        argv = server_arguments(VLLMRolloutConfig(model_path="/m", mode="server", max_lora_rank=16), "127.0.0.1", 8123)
        assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "16"
        assert argv[argv.index("--max-loras") + 1] == "1"

    def test_a_rank_vllm_has_no_size_for_is_refused(self):
        with pytest.raises(ValueError, match=r"max_lora_rank must be 0 \(no LoRA\) or one of vLLM's sizes \(1, 8, 16"):
            read_config_node({"model_path": "/m", "max_lora_rank": 4}, VLLMRolloutConfig)

    def test_the_adapter_folder_holds_peft_names_without_the_adapter_name_and_a_json_config(self, tmp_path):
        import torch
        from safetensors.torch import load_file

        lora_A, lora_B = torch.arange(6.0).reshape(2, 3), torch.ones(4, 2)
        config = {"r": 2, "lora_alpha": 4, "target_modules": {"v_proj", "q_proj"}, "peft_type": types.SimpleNamespace(value="LORA")}
        write_adapter(tmp_path / "adapter", config, [
            ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", lora_A),
            ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", lora_B),
        ])
        written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert written == {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
        tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
        assert sorted(tensors) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
        assert torch.equal(tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"], lora_A)

    def test_an_adapter_without_tensors_or_naming_one_twice_is_refused(self, tmp_path):
        import torch

        with pytest.raises(ValueError, match="no adapter tensors"):
            write_adapter(tmp_path / "empty", {"r": 2}, [])
        twice = [("m.q_proj.lora_A.default.weight", torch.ones(2, 3)), ("m.q_proj.lora_A.other.weight", torch.ones(2, 3))]
        with pytest.raises(ValueError, match=r"name 'm\.q_proj\.lora_A\.weight' twice"):
            write_adapter(tmp_path / "twice", {"r": 2}, twice)


class TestConfig:
    def test_an_unknown_key_names_the_known_ones(self):
        with pytest.raises(ValueError, match=r"unknown config key 'VLLMRolloutConfig.gpu_memory'. Did you mean 'VLLMRolloutConfig.gpu_memory_utilization'"):
            read_config_node({"model_path": "/m", "gpu_memory": 0.4}, VLLMRolloutConfig)

    def test_bad_values_are_named_together(self):
        with pytest.raises(ValueError) as caught:
            read_config_node({"model_path": "/m", "mode": "remote", "sleep_level": 3, "gpu_memory_utilization": 1.5}, VLLMRolloutConfig)
        message = str(caught.value)
        assert "mode must be one of" in message and "sleep_level" in message and "gpu_memory_utilization" in message

    def test_a_model_path_is_required_unless_attaching_to_a_server(self):
        with pytest.raises(ValueError, match="model_path is required"):
            read_config_node({}, VLLMRolloutConfig)
        read_config_node({"mode": "server", "server_url": "http://127.0.0.1:8000"}, VLLMRolloutConfig)

    def test_tensor_parallel_engines_are_refused(self):
        with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
            read_config_node({"model_path": "/m", "tensor_parallel_size": 2}, VLLMRolloutConfig)

    def test_server_url_in_hybrid_mode_is_refused(self):
        with pytest.raises(ValueError, match="set mode=server"):
            read_config_node({"model_path": "/m", "server_url": "http://127.0.0.1:8000"}, VLLMRolloutConfig)

    def test_lists_from_yaml_become_tuples(self):
        assert read_config_node({"model_path": "/m", "eos_token_ids": [2, 3]}, VLLMRolloutConfig).eos_token_ids == (2, 3)


class TestOutputs:
    def test_a_completion_becomes_tokens_log_probs_and_its_reason(self):
        out = sample_from_completion([5, 6, 2], logprob_positions([(5, -0.5), (6, -1.25), (2, -0.1)]), "stop", {2}, 8)
        assert out == TokenOutput([5, 6, 2], [-0.5, -1.25, -0.1], "stop")

    def test_length_and_a_missing_reason_are_told_from_the_tokens(self):
        assert sample_from_completion([5, 6], logprob_positions([(5, -1.0), (6, -1.0)]), "length", {2}, 2).finish_reason == "length"
        assert sample_from_completion([5, 2], logprob_positions([(5, -1.0), (2, -1.0)]), None, {2}, 8).finish_reason == "stop"

    def test_an_aborted_sample_is_an_error(self):
        with pytest.raises(RuntimeError, match="'abort'"):
            sample_from_completion([5], logprob_positions([(5, -1.0)]), "abort", {2}, 8)

    def test_missing_log_probs_are_an_error(self):
        with pytest.raises(RuntimeError, match="logprobs=0"):
            sample_from_completion([5, 6], None, "length", {2}, 2)

    def test_server_choices_are_ordered_by_index_prompt_major(self):
        response = {"choices": [
            {"index": 1, "token_ids": [7, 2], "logprobs": {"token_logprobs": [-0.2, -0.3]}, "finish_reason": "stop"},
            {"index": 0, "token_ids": [8, 9], "logprobs": {"token_logprobs": [-1.0, -2.0]}, "finish_reason": "length"},
        ]}
        samples = samples_from_completion_response(response, prompts=1, n=2, stop_token_ids={2}, max_new_tokens=2)
        assert samples == [TokenOutput([8, 9], [-1.0, -2.0], "length"), TokenOutput([7, 2], [-0.2, -0.3], "stop")]

    def test_a_short_server_answer_is_an_error(self):
        with pytest.raises(RuntimeError, match="1 choices for 2 prompts x n=1"):
            samples_from_completion_response({"choices": [{"index": 0}]}, prompts=2, n=1, stop_token_ids=(), max_new_tokens=4)


def test_the_completion_request_carries_token_prompts_and_asks_for_token_ids():
    payload = completion_payload([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=4, seed=1), eos_token_ids=(0,), model=None)
    assert payload["prompt"] == [[1, 2], [3]]
    assert payload["return_token_ids"] is True and payload["logprobs"] == 0 and payload["max_tokens"] == 4
    assert "detokenize" not in payload and "model" not in payload
    assert payload["seed"] == 1_000_003
    assert completion_payload([[3]], SamplingParams(n=2, seed=1), eos_token_ids=(0,), model=None, first_row=2)["seed"] == 1_000_003 + 2


def test_a_packed_chunk_becomes_the_ipc_update_info():
    chunk = types.SimpleNamespace(names=["a", "b"], dtype_names=["bfloat16", "bfloat16"], shapes=[[2, 3], [4]], tensor_sizes=[12, 8], ipc_handle={"GPU-1": ("args",)})
    assert packed_update_info(chunk) == {
        "names": ["a", "b"], "dtype_names": ["bfloat16", "bfloat16"], "shapes": [[2, 3], [4]],
        "ipc_handles": {"GPU-1": ("args",)}, "tensor_sizes": [12, 8],
    }


def test_the_models_length_comes_from_its_config_json(tmp_path):
    from rlplat_rollout_vllm.translate import model_max_length

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    assert model_max_length(str(tmp_path)) == 32768
    assert engine_kwargs(VLLMRolloutConfig(model_path=str(tmp_path)), cpu=True)["max_num_batched_tokens"] == 32768
    assert model_max_length(str(tmp_path / "missing")) == 0 and model_max_length(None) == 0


def test_on_cpu_the_plan_counts_a_kv_cache_of_cpu_kv_cache_gib_held_in_every_phase():
    from rlplat.contracts.memory import MemoryContext
    from rlplat_rollout_vllm.memory import estimate

    qwen2 = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    context = MemoryContext(role="rollout", processes=1, device="cpu", prompt_length=16, response_length=16, sequences_per_process=8,
                            free_between_phases=True)
    plan = estimate({"model_path": "/m", "dtype": "float32", "cpu_kv_cache_gib": 0.5}, qwen2, context)
    kv = next(item for item in plan.items if item.name == "KV cache")
    assert kv.bytes == 1 << 29 and kv.calls == ("resident",) and not plan.problems
    tiny = estimate({"model_path": "/m", "dtype": "float32", "cpu_kv_cache_gib": 1e-6}, qwen2, context)
    assert "cpu_kv_cache_gib=1e-06 holds" in tiny.problems[0] and "less than one sequence (32)" in tiny.problems[0]


def test_a_missing_cpp_compiler_is_named_before_vllms_cpu_backend_starts(monkeypatch, tmp_path):
    from rlplat_rollout_vllm.platform import cpp_compiler_problem

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no compiler
    assert "no C++ compiler on PATH (g++, clang++, c++; or set CXX)" in cpp_compiler_problem()
    compiler = tmp_path / "g++"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    assert cpp_compiler_problem() is None
    monkeypatch.setenv("CXX", "/nonexistent/clang++")
    assert cpp_compiler_problem() == "CXX='/nonexistent/clang++' is not an executable on PATH"


# -- partial rollouts: versions, aborts, the token route ----------------------------------------------------

class TestVersionsFromSpans:
    def test_spans_become_one_version_per_token_from_vllms_objects_or_their_json(self):
        objects = [types.SimpleNamespace(version="3", start=0, end=2), types.SimpleNamespace(version="4", start=2, end=5)]
        assert versions_from_spans(objects, 5) == [3, 3, 4, 4, 4]
        assert versions_from_spans([{"version": "7", "start": 0, "end": 1}], 1) == [7]

    def test_no_tokens_need_no_spans(self):
        assert versions_from_spans(None, 0) == [] and versions_from_spans([], 0) == []

    @pytest.mark.parametrize("spans, count, message", [
        (None, 2, "no weights versions for 2"),
        ([{"version": "1", "start": 0, "end": 2}], 3, "cover 2 tokens of 3"),
        ([{"version": "1", "start": 1, "end": 2}], 2, "do not cover"),
        ([{"version": "default", "start": 0, "end": 2}], 2, "labelled 'default'"),
    ], ids=["missing", "short", "gap", "not-a-version"])
    def test_spans_that_do_not_number_every_token_are_refused(self, spans, count, message):
        with pytest.raises(RuntimeError, match=message):
            versions_from_spans(spans, count)


def test_an_abort_is_kept_as_the_finish_reason_and_the_others_are_checked_as_before():
    assert token_finish_reason([5, 6], {2}, 8, "abort") == "abort"
    assert token_finish_reason([], {2}, 8, "abort") == "abort"
    assert token_finish_reason([5, 2], {2}, 8, "stop") == "stop"
    with pytest.raises(RuntimeError, match="finish reason 'error'"):
        token_finish_reason([5], {2}, 8, "error")


def test_every_request_names_the_weights_it_is_sampled_with_in_its_prefix_cache_salt():
    assert cache_salt(0) != cache_salt(1) and cache_salt(3) == "rlplat-weights-3"
    payload = completion_payload([[1, 2]], SamplingParams(), (2,), None, salt=cache_salt(1))
    assert payload["cache_salt"] == "rlplat-weights-1"
    assert "cache_salt" not in completion_payload([[1, 2]], SamplingParams(), (2,), None)


def test_the_token_route_request_names_the_request_and_samples_as_the_completion_does():
    sampling = SamplingParams(temperature=0.5, max_new_tokens=9, stop_token_ids=(4,), seed=2)
    payload = generate_payload("rlplat-1", (1, 5), sampling, (2,), "adapter-3", cache_salt(2))
    assert payload == {"request_id": "rlplat-1", "token_ids": [1, 5], "output_mode": "tokens", "model": "adapter-3",
                       "cache_salt": "rlplat-weights-2", "sampling_params": sampling_kwargs(sampling, (2,))}
    assert "model" not in generate_payload("rlplat-1", [1], sampling, (), None)


def test_a_token_route_answer_becomes_a_sample_with_each_tokens_version():
    choice = {"index": 0, "token_ids": [5, 2], "finish_reason": "stop",
              "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 2, "logprob": -1.5}]},
              "weight_versions": [{"version": "6", "start": 0, "end": 1}, {"version": "7", "start": 1, "end": 2}]}
    assert sample_from_generate_response({"choices": [choice]}, {2}, 8) == TokenOutput([5, 2], [-0.5, -1.5], "stop", versions=[6, 7])
    aborted = {"index": 0, "token_ids": [], "finish_reason": "abort", "logprobs": None, "weight_versions": []}
    assert sample_from_generate_response({"choices": [aborted]}, {2}, 8) == TokenOutput([], [], "abort", versions=[])
    with pytest.raises(RuntimeError, match="lacks token_ids or their log-probs"):
        sample_from_generate_response({"choices": [{**choice, "logprobs": None}]}, {2}, 8)


def test_an_engine_stepped_in_this_process_runs_without_async_scheduling():
    config = VLLMRolloutConfig(model_path="/m", engine_kwargs={"max_logprobs": 4})
    assert engine_kwargs(config, in_process=True)["async_scheduling"] is False
    assert "async_scheduling" not in engine_kwargs(config)
    assert engine_kwargs(VLLMRolloutConfig(model_path="/m", engine_kwargs={"async_scheduling": True}), in_process=True)["async_scheduling"] is True


class TestScoring:
    """``score_tokens``: rows as vLLM requests (prompt log-probs), vLLM's answers back."""

    def batch(self, **changes):
        """Prompt width 3, response width 3: a padded prompt and response, a full row, a row without response."""
        tensors = {
            "input_ids": [[0, 1, 5, 6, 7, 0], [1, 4, 9, 8, 2, 3], [0, 0, 1, 0, 0, 0]],
            "attention_mask": [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]],
            "position_ids": [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]],
            "responses": [[6, 7, 0], [8, 2, 3], [0, 0, 0]],
        }
        tensors.update(changes)
        return [torch.tensor(tensors[key]) for key in ("input_ids", "attention_mask", "position_ids", "responses")]

    def test_each_row_is_its_tokens_without_padding_and_where_its_response_starts(self):
        assert scoring_rows(*self.batch()) == [ScoringRow([1, 5, 6, 7], 2, 2), ScoringRow([1, 4, 9, 8, 2, 3], 3, 3), ScoringRow([1], 1, 0)]

    @pytest.mark.parametrize("changes, message", [
        ({"attention_mask": [[0, 1, 1, 1, 0, 1], [1] * 6, [0, 0, 1, 0, 0, 0]]}, "row 0: its attention_mask has holes"),
        ({"attention_mask": [[0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0]]}, "row 1: its response has no prompt token"),
        ({"position_ids": [[0, 0, 1, 2, 3, 4], [0, 1, 2, 4, 5, 6], [0, 0, 0, 1, 2, 3]]}, "row 1: its position_ids are not 0, 1, ..."),
        ({"responses": [[6, 9, 0], [8, 2, 3], [0, 0, 0]]}, "row 0: the response columns of input_ids differ from responses"),
        ({"position_ids": [[[0] * 6] * 3] * 3}, r"takes position_ids \[B, P\+R\]"),
    ], ids=["holes", "no-prompt", "positions", "responses", "mrope"])
    def test_rows_vllm_cannot_score_as_given_are_refused_by_row(self, changes, message):
        with pytest.raises(ValueError, match=message):
            scoring_rows(*self.batch(**changes))

    def test_what_vllms_limits_refuse_is_named_with_the_setting_to_change(self):
        rows = [ScoringRow([1] * 5, 2, 3), ScoringRow([1] * 8, 4, 4), ScoringRow([1] * 9, 9, 0)]
        assert "top_k=5 is above vLLM's max_logprobs=4" in scoring_limits_problem(rows, 5, 4, 100)
        too_long = scoring_limits_problem(rows, 4, 4, 8)  # row 2 has no response tokens: it is not sent
        assert too_long.startswith("row 1 has 8 tokens") and too_long.endswith("max_model_len (a teacher's: its rollout_config) to at least 9")
        assert scoring_limits_problem(rows, 5, -1, 9) is None and scoring_limits_problem(rows, 50, None, None) is None

    def test_the_request_asks_prompt_log_probs_and_one_greedy_token(self):
        assert score_kwargs(3) == {"n": 1, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 3, "detokenize": False}
        assert score_payload([[1, 2], (3, 4, 5)], 0, "adapter-2", cache_salt(1)) == {
            "prompt": [[1, 2], [3, 4, 5]], "n": 1, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
            "model": "adapter-2", "cache_salt": "rlplat-weights-1"}

    def test_the_response_positions_are_read_from_vllms_objects_or_their_json(self):
        """Position 2 (token 6): the token outside the top 2 (rank 4); position 3 (token 7): the token is the top 1, so
        its entry is the top-k's (vLLM writes it first with its own rank, then the top-k over it)."""
        positions = [None, {5: (-1.0, 1), 3: (-2.0, 2)}, {6: (-3.0, 4), 2: (-0.5, 1), 4: (-1.5, 2)}, {7: (-0.25, 1), 1: (-2.5, 2)}]
        objects = [None] + [{token: types.SimpleNamespace(logprob=value, rank=rank) for token, (value, rank) in position.items()}
                            for position in positions[1:]]
        json_form = [None] + [{str(token): {"logprob": value, "rank": rank, "decoded_token": "x"} for token, (value, rank) in position.items()}
                              for position in positions[1:]]
        row = ScoringRow([1, 5, 6, 7], 2, 2)
        expected = ([-3.0, -0.25], [[-0.5, -1.5], [-0.25, -2.5]], [[2, 4], [7, 1]])
        assert scored_response(objects, row, 2) == scored_response(json_form, row, 2) == expected
        assert scored_response(objects, row, 0) == ([-3.0, -0.25], [[], []], [[], []])
        with pytest.raises(RuntimeError, match="3 prompt log-prob positions for a request of 4 tokens"):
            scored_response(objects[:3], row, 2)
        with pytest.raises(RuntimeError, match="rank \\[1, 2\\], not the top 3"):
            scored_response(objects, row, 3)
