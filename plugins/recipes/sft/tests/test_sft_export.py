"""``rlplat export`` of ``rlplat sft`` runs: the command's registration tells the export how to read them
(its run config and engine node), an intermediate checkpoint exports the engine's weights at that step,
and LoRA runs export merged or as an adapter peft loads."""

from __future__ import annotations

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from rlplat import registry
from rlplat.kits.data import write_parquet
from rlplat.protocol import DataProto
from rlplat.testing.tiny_models import arithmetic_tokenizer, save_tiny_model

pytestmark = pytest.mark.slow  # whole runs: left out of `make test-fast`

TOLERANCE = 1e-5
SEQUENCES = ["12+34=46", "40+20=60", "15+16=31", "77+11=88"]  # prompt "a+b=", response the sum (one length)
RESPONSE_LENGTH = 2
ENGINE_HAS_LORA = getattr(registry.get("engine", "fsdp2"), "supports_lora", False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return {"model": save_tiny_model(tmp_path_factory.mktemp("export_assets") / "model", seed=0)}


def scoring_batch() -> DataProto:
    """The :data:`SEQUENCES` tokenised (BOS first), each response the last ``RESPONSE_LENGTH`` tokens."""
    input_ids = torch.tensor(arithmetic_tokenizer()(SEQUENCES)["input_ids"])
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
        "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous(),
        "responses": input_ids[:, -RESPONSE_LENGTH:],
    })


def hf_log_probs(model, batch: DataProto) -> torch.Tensor:
    """Log-probs of ``responses`` under a plain ``transformers`` (or ``peft``) model."""
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                       position_ids=batch.batch["position_ids"]).logits.float()
    log_probs = torch.log_softmax(logits[:, -RESPONSE_LENGTH - 1:-1], -1)
    return log_probs.gather(-1, batch.batch["responses"][..., None]).squeeze(-1)


def test_the_sft_command_tells_the_export_how_to_read_its_runs():
    from rlplat.cli.export import ENGINE_NODE, RUN_CONFIG, run_commands
    from rlplat.registry import resolve_dotted_path
    from rlplat_sft.config import SFTConfig, sft_engine_node

    entry = run_commands()["sft"]
    assert entry.distribution == "rlplat-sft"
    assert resolve_dotted_path(entry.metadata[RUN_CONFIG]) is SFTConfig
    assert resolve_dotted_path(entry.metadata[ENGINE_NODE]) is sft_engine_node


def train_sft(assets, run, steps, *extra):
    """An ``rlplat sft`` run of ``steps`` steps (a checkpoint every 2 steps and at the end), in process."""
    from rlplat_sft.config import load_sft_config
    from rlplat_sft.trainer import run_sft

    run_sft(load_sft_config(None, [
        f"model.path={assets['model']}", f"data.train_files=[{assets['sft_train']}]", "data.train_batch_size=4",
        "actor.optim.lr=1e-2", "actor.micro_batch_size_per_gpu=4", f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2", f"trainer.output_dir={run}", "trainer.logger=[jsonl]", "cluster.backend=local",
        "cluster.threads_per_process=1", *extra]))
    return run


@pytest.fixture(scope="module")
def sft_assets(assets, tmp_path_factory):
    rows = [{"prompt": f"{a}+{a % 7}=", "response": str(a + a % 7)} for a in range(10, 26)]
    return {**assets, "sft_train": write_parquet(rows, tmp_path_factory.mktemp("sft_data") / "train.parquet")}


@pytest.fixture(scope="module")
def sft_run(sft_assets, tmp_path_factory):
    """A 2-step ``rlplat sft`` run, its end-of-run export kept as ``step_2_model``, then continued to step
    3: its ``global_step_2`` checkpoint is an intermediate one."""
    root = tmp_path_factory.mktemp("sft_run")
    train_sft(sft_assets, root / "run", 2)
    shutil.copytree(root / "run" / "hf_model", root / "step_2_model")
    train_sft(sft_assets, root / "run", 3)
    return root


def hf_weights(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def assert_same_weights(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    assert [name for name in left if not torch.equal(left[name], right[name])] == []


def test_an_sft_runs_intermediate_checkpoint_exports_the_engines_weights_at_that_step(sft_run, tmp_path, cli_in_process):
    from transformers import AutoTokenizer

    out = tmp_path / "step_2"
    result = cli_in_process("export", str(sft_run / "run"), "--step", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "global_step_2 (step 2), trained by rlplat sft" in result.stderr
    exported = hf_weights(out)
    assert_same_weights(exported, hf_weights(sft_run / "step_2_model"))
    final = hf_weights(sft_run / "run" / "hf_model")  # step 3: the export took the checkpoint asked for
    assert any(not torch.equal(exported[name], final[name]) for name in final)
    assert AutoTokenizer.from_pretrained(out)("7+7=")["input_ids"] == arithmetic_tokenizer()("7+7=")["input_ids"]


def test_a_missing_step_is_refused_with_the_steps_saved(sft_run, tmp_path, cli_in_process):
    result = cli_in_process("export", str(sft_run / "run"), "--step", "1", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "--step 1: " in result.stderr and "the complete ones are of steps 2, 3" in result.stderr
    assert not (tmp_path / "out").exists()


def test_only_the_engines_own_keys_change_for_the_export(sft_run, tmp_path, cli_in_process):
    refused = cli_in_process("export", str(sft_run / "run"), "--out", str(tmp_path / "out"), "trainer.seed=3")
    assert refused.returncode == 2
    assert "'trainer.seed=3': the export takes only the engine's own keys, as actor.engine_config.KEY=VALUE" in refused.stderr
    misspelled = cli_in_process("export", str(sft_run / "run"), "--out", str(tmp_path / "out"),
                                "actor.engine_config.use_remove_paddin=true")
    assert misspelled.returncode == 2
    assert "with actor.engine_config.use_remove_paddin=true: " in misspelled.stderr and "use_remove_padding" in misspelled.stderr
    assert not (tmp_path / "out").exists()


def test_a_run_of_neither_command_is_refused(sft_run, tmp_path, cli_in_process):
    shutil.copytree(sft_run / "run" / "checkpoints", tmp_path / "run" / "checkpoints")
    config = OmegaConf.load(sft_run / "run" / "config.yaml")
    config.pop("loss")
    config.evaluation = {"metric": "accuracy"}
    OmegaConf.save(config, tmp_path / "run" / "config.yaml")
    result = cli_in_process("export", str(tmp_path / "run"), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "is not the config of a run any installed command writes (rlplat run, rlplat sft; a plugin's command needs " \
           "that plugin installed): its top-level nodes are actor, cluster, data, evaluation, model, trainer" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not ENGINE_HAS_LORA, reason="the fsdp2 engine has no LoRA adapters (FSDP2Engine.supports_lora is False)")
def test_an_sft_lora_run_exports_merged_and_as_an_adapter_peft_loads(sft_assets, tmp_path, cli_in_process):
    import peft
    from transformers import AutoModelForCausalLM

    run = train_sft(sft_assets, tmp_path / "run", 2, "actor.lora.rank=4", "actor.lora.alpha=8")
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for arguments in (["--out", str(merged)], ["--out", str(adapter), "--adapter"]):
        result = cli_in_process("export", str(run), *arguments)
        assert result.returncode == 0, result.stderr
    assert_same_weights(hf_weights(merged), hf_weights(run / "hf_model"))  # the run's own export, at its end
    batch = scoring_batch()
    merged_log_probs = hf_log_probs(AutoModelForCausalLM.from_pretrained(merged).eval(), batch)
    with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_assets["model"]), adapter).eval()
    assert (hf_log_probs(with_adapter, batch) - merged_log_probs).abs().max() < TOLERANCE
    with with_adapter.disable_adapter():  # the adapter was trained: the base model differs
        assert (hf_log_probs(with_adapter, batch) - merged_log_probs).abs().max() > 1e-3
