"""LoRA adapters in the fsdp2 engine (``lora``: the ``actor.lora`` node), on one process; the two-process
case is in test_lora_distributed.py.

The tiny model (``rlplat.testing.engines.TINY_QWEN2``, the demo's architecture): hidden 128, intermediate 512, 2
layers, q/k/v/o 128 -> 128, gate/up 128 -> 512, down 512 -> 128, tied embeddings (the output head is
the embedding). ``all-linear`` puts an adapter on the 7 projections of each layer and not on the head.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlplat import DataProto
from rlplat.testing.tiny_models import save_tiny_model
from rlplat_engine_fsdp2.engine import FSDP2Engine
from rlplat_engine_fsdp2.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE


def policy_gradient(outputs, micro_batch):
    batch = micro_batch.batch
    return -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"], {}


def built(config: dict, **overrides) -> FSDP2Engine:
    engine = FSDP2Engine(config, **overrides)
    engine.init_model()
    return engine


def lora(rank: int = 4, **settings) -> dict:
    return {"rank": rank, "alpha": 2.0 * rank, **settings}


def named_weights_of(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in engine.named_weights() for name, tensor in bucket}


def base_parameters(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in engine.module.named_parameters() if ".lora_" not in name}


def masked(log_probs: torch.Tensor, batch: DataProto) -> torch.Tensor:
    return log_probs * batch.batch["response_mask"]


def hf_log_probs(model: torch.nn.Module, batch: DataProto) -> torch.Tensor:
    """Response log-probs of a plain Hugging Face (or peft) causal LM on padded rows, 0 outside the mask."""
    data = batch.batch
    response_length = data["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], position_ids=data["position_ids"]).logits
    log_softmax = logits[:, -response_length - 1 : -1].float().log_softmax(-1)
    return masked(log_softmax.gather(-1, data["responses"].unsqueeze(-1)).squeeze(-1), batch)


@pytest.fixture
def model_dir(tmp_path) -> str:
    """A tiny Qwen2 saved as a local Hugging Face directory (with the arithmetic tokenizer)."""
    return save_tiny_model(tmp_path / "base", seed=3)


def from_directory(model_dir: str) -> dict:
    return {"model_path": model_dir, "dtype": "float32", "lr": 1e-2, "micro_batch_size_per_gpu": 2}


def trained(model_dir: str, batch_of, steps: int = 2, **overrides) -> FSDP2Engine:
    engine = built(from_directory(model_dir), lora=lora(), **overrides)
    for seed in range(steps):
        engine.train_batch(batch_of(8, seed=seed), policy_gradient)
    return engine


# -- what trains ----------------------------------------------------------------------------------------


def test_all_linear_trains_rank_times_in_plus_out_per_projection_and_nothing_else(tiny_config):
    engine = built(tiny_config, lora=lora(rank=4))
    # Per layer: q, k, v, o: 4 * (128 + 128) each; gate, up: 4 * (128 + 512); down: 4 * (512 + 128).
    analytic = 2 * (4 * 4 * (128 + 128) + 3 * 4 * (128 + 512))
    trainable = {name: parameter for name, parameter in engine.module.named_parameters() if parameter.requires_grad}
    assert analytic == 23552 == engine.trainable_params == sum(parameter.numel() for parameter in trainable.values())
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert not any("lm_head" in name or "embed_tokens" in name for name in trainable)
    optimized = {id(parameter) for group in engine.optimizer.param_groups for parameter in group["params"]}
    assert optimized == {id(parameter) for parameter in trainable.values()}


def test_target_and_exclude_modules_choose_the_projections(tiny_config):
    # q_proj and v_proj of both layers, less layer 1's q_proj: 3 projections of 8 * (128 + 128).
    engine = built(tiny_config, lora=lora(rank=8, target_modules=["q_proj", "v_proj"], exclude_modules=["model.layers.1.self_attn.q_proj"]))
    assert engine.trainable_params == 3 * 8 * (128 + 128)
    adapted = sorted({name.split(".lora_")[0] for name, _ in engine.module.named_parameters() if ".lora_" in name})
    assert adapted == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"]


def test_an_untied_output_head_gets_no_adapter_from_all_linear(tiny_config):
    config = {**tiny_config, "model_config": {**tiny_config["model_config"], "tie_word_embeddings": False}}
    engine = built(config, lora=lora(rank=4))
    assert engine.trainable_params == 23552
    assert not any("lm_head" in name for name, parameter in engine.module.named_parameters() if parameter.requires_grad)


def test_the_metrics_report_trainable_parameters_and_optimizer_state_with_and_without_lora(tiny_config, batch_of):
    with_lora = built(tiny_config, lora=lora(rank=4)).train_batch(batch_of(4), policy_gradient)
    full = built(tiny_config).train_batch(batch_of(4), policy_gradient)
    # AdamW: two float32 moments per trainable parameter and one float32 step counter per tensor (28
    # adapter tensors; 26 in the full model: the embedding (the tied head), 12 per layer, the final norm).
    assert with_lora["trainable_params"] == 23552 and with_lora["optimizer_state_bytes"] == 23552 * 8 + 28 * 4
    assert full["trainable_params"] == 527744 and full["optimizer_state_bytes"] == 527744 * 8 + 26 * 4


def test_optimizer_state_on_the_demo_model_is_under_5_percent_of_full_fine_tuning(batch_of):
    from rlplat_demo import model_dir

    config = {"model_path": str(model_dir()), "dtype": "float32", "micro_batch_size_per_gpu": 8}
    with_lora = built(config, lora=lora(rank=4)).train_batch(batch_of(4), policy_gradient)
    full = built(config).train_batch(batch_of(4), policy_gradient)
    ratio = with_lora["optimizer_state_bytes"] / full["optimizer_state_bytes"]
    print(f"demo model, all-linear rank 4: optimizer state {with_lora['optimizer_state_bytes']:.0f} B vs {full['optimizer_state_bytes']:.0f} B "
          f"({ratio:.2%}); trainable {with_lora['trainable_params']:.0f} of {full['trainable_params']:.0f}")
    assert ratio <= 0.05


def test_activation_checkpointing_does_not_change_the_adapter_gradient(tiny_config, batch_of):
    gradients = []
    for checkpointing in (False, True):
        engine = built(tiny_config, lora=lora(), grad_clip=None, enable_gradient_checkpointing=checkpointing)
        engine.train_batch(batch_of(8), policy_gradient)  # moves lora_B off zero, so lora_A gets a gradient too
        engine.train_batch(batch_of(8, seed=1), policy_gradient)
        gradients.append({name: parameter.grad for name, parameter in engine.module.named_parameters() if parameter.grad is not None})
    plain, checkpointed = gradients
    assert plain.keys() == checkpointed.keys() and len(plain) == 28
    assert max(float((plain[name] - checkpointed[name]).abs().max()) for name in plain) <= 1e-6

# -- the reference policy -------------------------------------------------------------------------------


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("shard_one_rank", [False, True], ids=["plain module", "fully_shard"])
def test_the_reference_equals_the_actor_at_step_0_and_stays_the_base_model_after_training(tiny_config, batch_of, use_remove_padding, shard_one_rank):
    engine = built(tiny_config, lora=lora(rank=4, dropout=0.1), use_remove_padding=use_remove_padding, shard_one_rank=shard_one_rank)
    base = base_parameters(engine)
    batch = batch_of(8)
    actor = engine.forward(batch).batch["log_probs"]
    with engine.adapter_disabled():
        reference = engine.forward(batch, calculate_entropy=True).batch
    assert torch.equal(actor, reference["log_probs"])  # lora_B starts at zero: not one bit differs
    engine.train_batch(batch, policy_gradient)
    after = base_parameters(engine)
    assert all(torch.equal(after[name], base[name]) for name in base)
    with engine.adapter_disabled():
        reference_after = engine.forward(batch, calculate_entropy=True).batch
    assert torch.equal(reference_after["log_probs"], reference["log_probs"]) and torch.equal(reference_after["entropy"], reference["entropy"])
    assert float((masked(engine.forward(batch).batch["log_probs"] - actor, batch)).abs().max()) > 1e-3


def test_training_inside_adapter_disabled_is_refused_and_the_adapter_comes_back(tiny_config, batch_of):
    engine = built(tiny_config, lora=lora())
    engine.train_batch(batch_of(4), policy_gradient)
    actor = engine.forward(batch_of(4)).batch["log_probs"]
    with engine.adapter_disabled(), pytest.raises(RuntimeError, match="inside adapter_disabled"):
        engine.train_batch(batch_of(4), policy_gradient)
    assert torch.equal(engine.forward(batch_of(4)).batch["log_probs"], actor)
    assert all(parameter.requires_grad for name, parameter in engine.module.named_parameters() if ".lora_" in name)


def test_an_engine_without_lora_has_no_adapter_to_disable_or_export(tiny_config, tmp_path):
    engine = built(tiny_config)
    with pytest.raises(RuntimeError, match="trains full weights"), engine.adapter_disabled():
        pass
    with pytest.raises(RuntimeError, match="trains full weights"):
        engine.export_adapter(str(tmp_path / "adapter"))
    assert engine.adapter_weights() is None


# -- merged weights and exports --------------------------------------------------------------------------


def test_named_weights_are_the_merged_model_in_plain_names_and_equal_peft_merge_and_unload(model_dir, batch_of, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    engine = trained(model_dir, batch_of)
    merged = named_weights_of(engine)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert sorted(merged) == sorted(name for name, _ in plain.named_parameters())  # no base_layer., no lora_ tensors
    assert engine.shared_weights() is None
    engine.export_adapter(str(tmp_path / "adapter"))
    peft_merged = peft.PeftModel.from_pretrained(plain, str(tmp_path / "adapter")).merge_and_unload()
    expected = dict(peft_merged.named_parameters())
    # Bit for bit, as lora.py promises: merged_weight is peft's formula in peft's order on the same tensors,
    # elementwise but for B @ A, whose rank-4 sums run through the same kernel at the same shapes.
    assert all(torch.equal(merged[name], expected[name]) for name in merged)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert max(float((merged[name] - base[name]).abs().max()) for name in merged) > 1e-3  # the adapter moved the weights


def test_named_weights_inside_adapter_disabled_are_the_base_weights_in_plain_names(model_dir, batch_of):
    from transformers import AutoModelForCausalLM

    engine = trained(model_dir, batch_of)
    with engine.adapter_disabled():
        base = named_weights_of(engine)
    expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert base.keys() <= expected.keys() and all(torch.equal(base[name], expected[name]) for name in base)
    assert not all(torch.equal(merged, base[name]) for name, merged in named_weights_of(engine).items())


def test_the_merged_export_loads_in_plain_transformers_and_reproduces_the_engine(model_dir, batch_of, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = trained(model_dir, batch_of)
    engine.export_hf(str(tmp_path / "merged"))
    assert not (tmp_path / "merged" / ADAPTER_CONFIG_FILE).exists()
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    batch = batch_of(8, seed=5)
    expected = masked(engine.forward(batch).batch["log_probs"], batch)
    assert float((hf_log_probs(exported, batch) - expected).abs().max()) <= 1e-5
    merged = named_weights_of(engine)
    assert all(torch.equal(parameter, merged[name]) for name, parameter in exported.named_parameters())
    assert AutoTokenizer.from_pretrained(str(tmp_path / "merged"))("12+3=")["input_ids"] == [1, 5, 6, 14, 7, 15]


def test_the_exported_adapter_loads_in_peft_and_reproduces_the_engine(model_dir, batch_of, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    engine = trained(model_dir, batch_of)
    engine.export_adapter(str(tmp_path / "adapter"))
    assert sorted(path.name for path in (tmp_path / "adapter").iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]
    config, tensors = engine.adapter_weights()
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text()) == config == json.loads(json.dumps(config))
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA" and config["base_model_name_or_path"] == model_dir
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), str(tmp_path / "adapter")).eval()
    assert dict(tensors).keys() == peft.get_peft_model_state_dict(loaded).keys()
    assert all(torch.equal(tensor, peft.get_peft_model_state_dict(loaded)[name]) for name, tensor in tensors)
    batch = batch_of(8, seed=5)
    expected = masked(engine.forward(batch).batch["log_probs"], batch)
    assert float((hf_log_probs(loaded, batch) - expected).abs().max()) <= 1e-5


def test_an_engine_starts_from_an_adapter_folder_and_trains_it(model_dir, batch_of, tmp_path):
    source = trained(model_dir, batch_of)
    source.export_adapter(str(tmp_path / "adapter"))
    batch = batch_of(8, seed=5)
    started = built(from_directory(model_dir), lora=lora(adapter_path=str(tmp_path / "adapter")))
    # Exact: both engines read the base weights from the same files (so they sit at the same alignment),
    # hold the adapter in allocations of their own, and run the same micro-batches of 2 rows through the
    # same kernels in this process.
    assert torch.equal(started.forward(batch).batch["log_probs"], source.forward(batch).batch["log_probs"])
    assert started.train_batch(batch, policy_gradient)["trainable_params"] == 23552
    with pytest.raises(ValueError, match="has rank 4 and alpha 8.0, actor.lora says rank 8"):
        built(from_directory(model_dir), lora=lora(rank=8, adapter_path=str(tmp_path / "adapter")))


# -- checkpoints -----------------------------------------------------------------------------------------


def directory_bytes(path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def test_an_adapter_checkpoint_of_the_demo_model_is_under_10_percent_of_a_full_one(batch_of, tmp_path):
    from rlplat_demo import model_dir

    config = {"model_path": str(model_dir()), "dtype": "float32", "micro_batch_size_per_gpu": 8}
    for name, overrides in (("adapter", {"lora": lora(rank=4)}), ("full", {})):
        engine = built(config, **overrides)
        engine.train_batch(batch_of(4), policy_gradient)
        engine.save(str(tmp_path / name))
    ratio = directory_bytes(tmp_path / "adapter") / directory_bytes(tmp_path / "full")
    print(f"demo model checkpoint: adapter (rank 4) {directory_bytes(tmp_path / 'adapter')} B, full {directory_bytes(tmp_path / 'full')} B ({ratio:.2%})")
    assert ratio <= 0.10
    assert json.loads((tmp_path / "adapter" / "checkpoint.json").read_text())["adapter_only"] is True


@pytest.mark.parametrize("shard_one_rank", [False, True], ids=["plain module", "fully_shard"])
def test_save_load_then_the_next_steps_equal_not_stopping(model_dir, batch_of, tmp_path, shard_one_rank):
    # Dropout on the adapter's input makes the restored RNG matter: the engines share this process's RNG,
    # so the resumed one loads after the uninterrupted one has drawn its masks. It draws another lora_A
    # (seed 99) that the checkpoint must replace.
    options = dict(lora=lora(dropout=0.1), shard_one_rank=shard_one_rank, lr_warmup_steps=2, lr_scheduler_type="cosine", total_training_steps=6)
    uninterrupted, resumed = built(from_directory(model_dir), seed=7, **options), built(from_directory(model_dir), seed=99, **options)
    for seed in range(2):
        uninterrupted.train_batch(batch_of(4, seed=seed), policy_gradient)
    uninterrupted.save(str(tmp_path / "checkpoint"))
    expected = [uninterrupted.train_batch(batch_of(4, seed=seed), policy_gradient) for seed in range(2, 4)]
    resumed.load(str(tmp_path / "checkpoint"))
    # Exact resume is the project's promise: both engines read the base from the same files, the checkpoint
    # restores adapter, optimizer, schedule and RNG, and the same micro-batches run through the same kernels.
    assert [resumed.train_batch(batch_of(4, seed=seed), policy_gradient) for seed in range(2, 4)] == expected
    after_uninterrupted, after_resumed = named_weights_of(uninterrupted), named_weights_of(resumed)
    assert all(torch.equal(after_resumed[name], after_uninterrupted[name]) for name in after_uninterrupted)
    assert resumed.state() == uninterrupted.state()


def test_a_checkpoint_of_the_other_kind_is_refused(tiny_config, tmp_path):
    built(tiny_config).save(str(tmp_path / "full"))
    built(tiny_config, lora=lora()).save(str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="holds full weights .* but this engine trains a LoRA adapter"):
        built(tiny_config, lora=lora()).load(str(tmp_path / "full"))
    with pytest.raises(ValueError, match="holds a LoRA adapter .* but this engine trains full weights"):
        built(tiny_config).load(str(tmp_path / "adapter"))


def test_an_adapter_checkpoint_is_not_loaded_onto_other_base_weights(tiny_config, tmp_path):
    built(tiny_config, lora=lora()).save(str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="trained on other base weights"):
        built({**tiny_config, "seed": 8}, lora=lora()).load(str(tmp_path / "adapter"))  # another seed draws another base


# -- config ----------------------------------------------------------------------------------------------


def test_lora_is_refused_for_value_and_reward_models_and_with_rank_0(tiny_config):
    with pytest.raises(ValueError, match="a value model or reward model cannot take it"):
        FSDP2Engine(tiny_config, lora=lora(), value_model=True)
    with pytest.raises(ValueError, match="rank 0; leave it out"):
        FSDP2Engine(tiny_config, lora={"rank": 0})
    with pytest.raises(ValueError, match="dropout must be in"):
        FSDP2Engine(tiny_config, lora=lora(dropout=1.5))


def test_target_modules_that_match_nothing_or_the_head_are_refused(tiny_config):
    with pytest.raises(ValueError, match="could not place adapters"):
        built(tiny_config, lora=lora(target_modules=["no_such_proj"]))
    untied = {**tiny_config, "model_config": {**tiny_config["model_config"], "tie_word_embeddings": False}}
    with pytest.raises(ValueError, match="other than the output head"):
        built(untied, lora=lora(target_modules=["q_proj", "lm_head"]))

