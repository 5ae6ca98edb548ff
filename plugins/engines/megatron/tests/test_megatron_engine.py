"""The megatron engine in this process (one rank): a Llama checkpoint against the fsdp2 engine, the value
head of a critic (values, training, export as a token classifier), and the layout checks at load."""

from __future__ import annotations

import pytest
import torch

from rlplat.testing.engines import TINY_QWEN2
from rlplat_engine_megatron.config import MegatronEngineConfig, check_layout
from rlplat_engine_megatron.engine import MegatronEngine


class ValueLoss:
    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        error = (outputs["values"] - batch["returns"]) ** 2 * batch["response_mask"]
        return 0.5 * error.sum() / micro_batch.meta_info["global_token_count"], {"test/vf": 1.0}


def test_a_llama_checkpoint_gives_the_fsdp2_engines_log_probs_and_entropy(tmp_path, batch_of):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlplat_engine_fsdp2.engine import FSDP2Engine

    config = AutoConfig.for_model("llama", vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(tmp_path / "llama"))
    batch = batch_of(6)
    megatron = MegatronEngine(dict(model_path=str(tmp_path / "llama")))
    megatron.init_model()
    fsdp2 = FSDP2Engine(dict(model_path=str(tmp_path / "llama"), dtype="float32"))
    fsdp2.init_model()
    ours, theirs = megatron.forward(batch, calculate_entropy=True), fsdp2.forward(batch, calculate_entropy=True)
    valid = batch.batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert float((ours.batch[key] - theirs.batch[key])[valid].abs().max()) <= 1e-5, key


def test_a_value_model_returns_values_trains_and_exports_a_token_classifier(tmp_path, tiny_config, batch_of):
    from transformers import AutoModelForTokenClassification

    engine = MegatronEngine({**tiny_config, "value_model": True})
    engine.init_model()
    batch = batch_of(6)
    values = engine.forward(batch).batch["values"]
    assert values.shape == batch.batch["responses"].shape and values.dtype == torch.float32
    metrics = engine.train_batch(batch, ValueLoss())
    assert metrics["grad_norm"] > 0 and metrics["test/vf"] == pytest.approx(3.0)  # 3 micro-batches of 2 rows
    after = engine.forward(batch).batch["values"]
    assert not torch.equal(after, values)
    engine.export_hf(str(tmp_path / "critic"))
    model = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"), dtype=torch.float32).eval()
    data = batch.batch
    with torch.no_grad():
        exported = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], position_ids=data["position_ids"]).logits
    response_length = data["responses"].shape[1]
    exported = exported[:, -response_length - 1 : -1, 0]
    valid = data["response_mask"].bool()
    assert float((exported - after)[valid].abs().max()) <= 1e-5


def test_layout_checks_name_every_size_that_does_not_fit():
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**{**TINY_QWEN2, "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 18})
    config = MegatronEngineConfig(model_config=dict(TINY_QWEN2), tensor_parallel_size=4, pipeline_parallel_size=2)
    with pytest.raises(ValueError) as raised:
        check_layout(config, 6, hf)
    message = str(raised.value)
    assert "world size 6" in message and "2 key/value heads" in message and "3 layers" in message and "18 tokens" in message
    assert check_layout(MegatronEngineConfig(model_config=dict(TINY_QWEN2), tensor_parallel_size=2), 4, AutoConfig.for_model(**TINY_QWEN2)) == 2


def test_a_layout_larger_than_the_world_is_refused_when_the_engine_is_built(tiny_config):
    engine = MegatronEngine({**tiny_config, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="world size 1 is not divisible by tensor_parallel_size=2 x pipeline_parallel_size=1 = 2"):
        engine.init_model()


def test_saving_before_the_first_step_is_refused_naming_the_path(tiny_config, tmp_path):
    engine = MegatronEngine(tiny_config)
    engine.init_model()
    with pytest.raises(RuntimeError, match="early-checkpoint.*before the first optimizer step"):
        engine.save(str(tmp_path / "early-checkpoint"))


def test_config_errors_are_raised_at_load():
    with pytest.raises(ValueError, match="exactly one of model_path"):
        MegatronEngineConfig()
    with pytest.raises(ValueError, match="recompute_granularity"):
        MegatronEngineConfig(model_config=dict(TINY_QWEN2), recompute_granularity="some")
    with pytest.raises(ValueError, match="virtual_pipeline_parallel_size needs"):
        MegatronEngineConfig(model_config=dict(TINY_QWEN2), virtual_pipeline_parallel_size=2)
    # the keys every engine config shares (rlplat.kits.engine.engine_config_problems), then the engine's own, in one error
    with pytest.raises(ValueError, match=r"invalid megatron engine config: betas needs two values, got \[0.9\]; lora is not supported"):
        MegatronEngineConfig(model_config=dict(TINY_QWEN2), betas=[0.9], lora={"rank": 4})
    with pytest.raises(Exception, match="tensor_paralel_size|tensor_parallel_size"):
        MegatronEngine(dict(model_config=dict(TINY_QWEN2), tensor_paralel_size=2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the substitutes exist on a CPU build only")
def test_cpu_substitutes_are_confined_to_the_engines_calls(tiny_config, batch_of):
    """After the engine's calls, CUDA requests fail again as a CPU build of torch makes them fail."""
    engine = MegatronEngine(tiny_config)
    engine.init_model()
    engine.forward(batch_of(2))
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1).cuda()
    assert torch.zeros(1).type() == "torch.FloatTensor"


class GatheredLoss:
    """Token-mean of the gathered log-probs' sum over the ``gather`` ids, reported as a metric contribution."""

    gather_ids = "gather"
    count_masks = ("half",)

    def __init__(self):
        self.counts: list[dict] = []

    def __call__(self, outputs, micro_batch):
        mask = micro_batch.batch["response_mask"] * micro_batch.batch["half"]
        counts = micro_batch.meta_info["global_counts"]["half"]
        self.counts.append(dict(counts))
        loss = (outputs["gathered_log_probs"].sum(-1) * mask).sum() / counts["tokens"]
        return loss, {"test/gathered": float(loss.detach())}


def test_top_k_and_gathered_log_probs_equal_the_fsdp2_engines(tmp_path, batch_of):
    """The distillation features (``features``): ``forward(top_k=k)`` and a loss's ``gather_ids`` and
    ``count_masks`` on the vocabulary-parallel logits (one rank here; TP=2 in test_megatron_numerics)."""
    from rlplat import DataProto
    from rlplat_engine_fsdp2.engine import FSDP2Engine
    from two_process_launch import write_checkpoint

    path = write_checkpoint(tmp_path / "qwen2", dict(TINY_QWEN2), seed=11)
    batch = batch_of(6)
    rows, width = batch.batch["responses"].shape
    generator = torch.Generator().manual_seed(2)
    half = torch.zeros(rows, width)
    half[::2] = 1
    extra = DataProto.from_dict({"gather": torch.randint(0, TINY_QWEN2["vocab_size"], (rows, width, 3), generator=generator),
                                 "half": half})
    data = batch.union(extra).with_meta_info({"ppo_mini_batch_size": rows})
    megatron = MegatronEngine(dict(model_path=path, micro_batch_size_per_gpu=4))
    megatron.init_model()
    fsdp2 = FSDP2Engine(dict(model_path=path, dtype="float32", micro_batch_size_per_gpu=4))
    fsdp2.init_model()
    valid = batch.batch["response_mask"].bool()
    ours, theirs = megatron.forward(batch, top_k=4).batch, fsdp2.forward(batch, top_k=4).batch
    assert float((ours["top_k_log_probs"] - theirs["top_k_log_probs"])[valid].abs().max()) <= 1e-5
    assert torch.equal(ours["top_k_ids"][valid], theirs["top_k_ids"][valid])
    our_loss, their_loss = GatheredLoss(), GatheredLoss()
    ours, theirs = megatron.train_batch(data, our_loss), fsdp2.train_batch(data, their_loss)
    assert ours["test/gathered"] == pytest.approx(theirs["test/gathered"], abs=1e-5)
    own = batch.batch["response_mask"] * half
    assert {tuple(sorted(c.items())) for c in our_loss.counts + their_loss.counts} == {
        (("sequences", int((own.sum(-1) > 0).sum())), ("tokens", float(own.sum())))}
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_the_chunked_output_layer_equals_the_whole_logits_in_forward_and_in_a_step(tmp_path, batch_of, monkeypatch):
    """Forced on (the tiny model's logits are far below the size that turns it on), 4 tokens a chunk: the
    forward's log-probs, entropy and top-k and a step's loss, gathered log-probs and gradient norm equal the
    whole-logits path's (two ranks at TP=2: test_megatron_numerics)."""
    from rlplat import DataProto
    from rlplat_engine_megatron import vocab_parallel
    from two_process_launch import write_checkpoint

    path = write_checkpoint(tmp_path / "qwen2", dict(TINY_QWEN2), seed=11)
    batch = batch_of(6)
    rows, width = batch.batch["responses"].shape
    gather = torch.randint(0, TINY_QWEN2["vocab_size"], (rows, width, 3), generator=torch.Generator().manual_seed(2))
    data = batch.union(DataProto.from_dict({"gather": gather, "half": torch.ones(rows, width)})).with_meta_info({"ppo_mini_batch_size": rows})
    valid = batch.batch["response_mask"].bool()
    found = {}
    for name, keep in (("whole", 1 << 40), ("chunked", 0)):
        monkeypatch.setattr(vocab_parallel, "KEEP_FLOAT32_BYTES", keep)
        engine = MegatronEngine(dict(model_path=path, micro_batch_size_per_gpu=4, logprob_chunk_size=4))
        engine.init_model()
        found[name] = (engine.forward(batch, calculate_entropy=True).batch, engine.forward(batch, top_k=3).batch,
                       engine.train_batch(data, GatheredLoss()))
    (whole, whole_top, whole_step), (chunked, chunked_top, chunked_step) = found["whole"], found["chunked"]
    for key in ("log_probs", "entropy"):
        assert float((whole[key] - chunked[key])[valid].abs().max()) <= 1e-6, key
    assert float((whole_top["top_k_log_probs"] - chunked_top["top_k_log_probs"])[valid].abs().max()) <= 1e-6
    assert torch.equal(whole_top["top_k_ids"][valid], chunked_top["top_k_ids"][valid])
    for key in ("loss", "test/gathered"):
        assert chunked_step[key] == pytest.approx(whole_step[key], abs=1e-6), key
    assert chunked_step["grad_norm"] == pytest.approx(whole_step["grad_norm"], rel=1e-5)


FRESH_WEIGHTS = """
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
from rlplat_engine_megatron.bridge import hf_config_of, materialise_model_config
from rlplat_engine_megatron.config import read_engine_config
config = read_engine_config({"model_config": json.loads(sys.argv[2]), "seed": 3})
directory = os.path.join(sys.argv[1], str(dist.get_rank()))
os.makedirs(directory)
materialise_model_config(config, hf_config_of(config), directory)
dist.barrier()
"""


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_every_rank_draws_the_same_fresh_weights_from_a_model_config(tmp_path, tied):
    """``model_config`` on two processes: each rank writes its own checkpoint of the weights transformers draws
    under the seed (transformers' save_pretrained writes on rank 0 only once torch.distributed is set up), the
    same on both, a tied output layer stored once."""
    import json

    from safetensors.torch import load_file

    from rlplat.testing.distributed import launch_ranks

    model = dict(TINY_QWEN2, tie_word_embeddings=tied)
    launch_ranks(2, ["-c", FRESH_WEIGHTS, str(tmp_path), json.dumps(model)], timeout=300)
    weights = [load_file(str(tmp_path / str(rank) / "model.safetensors")) for rank in range(2)]
    assert sorted(weights[0]) == sorted(weights[1]) and all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert ("lm_head.weight" in weights[0]) is not tied
    assert json.loads((tmp_path / "1" / "config.json").read_text())["tie_word_embeddings"] is tied
