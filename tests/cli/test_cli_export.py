"""``rlplat export``: an ``rlplat run`` checkpoint as a folder plain ``transformers`` (or ``peft``, for
``--adapter``) loads and that gives the trainer's engine's log-probs; bad inputs exit 2 naming the problem.
``rlplat sft`` runs: plugins/recipes/sft/tests/test_sft_export.py."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from rlplat import registry
from rlplat.config import engine_node, load_config
from rlplat.kits.data import write_parquet
from rlplat.protocol import DataProto
from rlplat.registry import EngineRegistry
from rlplat.testing.tiny_models import arithmetic_tokenizer, save_tiny_model
from rlplat.trainer import Trainer

pytestmark = pytest.mark.slow  # whole runs: left out of `make test-fast`

TOLERANCE = 1e-5
SEQUENCES = ["12+34=46", "40+20=60", "15+16=31", "77+11=88"]  # prompt "a+b=", response the sum (one length)
RESPONSE_LENGTH = 2
ENGINE_HAS_LORA = getattr(registry.get("engine", "fsdp2"), "supports_lora", False)
# partial credit for digits, so the tiny random model's samples score differently and the policy moves
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(character.isdigit() for character in solution_str) / 3
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_assets")
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{a}="}],
             "reward_model": {"ground_truth": str(2 * a)}} for a in range(8)]
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return {"model": save_tiny_model(root / "model", seed=0), "train": write_parquet(rows, root / "train.parquet"),
            "reward": str(reward)}


def train(assets, run, *extra):
    """A 2-step GRPO run with the local backend; its checkpoint is saved at the last step."""
    config = load_config(overrides=[
        f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=3", "actor.optim.lr=5e-2",
        "actor.micro_batch_size_per_gpu=4", f"reward.custom_function.path={assets['reward']}", "cluster.backend=local",
        "cluster.threads_per_process=1", f"trainer.output_dir={run}", "trainer.logger=[jsonl]",
        "trainer.val_before_train=false", "trainer.total_training_steps=2", *extra], algo="grpo")
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return run


@pytest.fixture(scope="module")
def full_run(assets, tmp_path_factory):
    return train(assets, tmp_path_factory.mktemp("full_run"))


@pytest.fixture(scope="module")
def lora_run(assets, tmp_path_factory):
    return train(assets, tmp_path_factory.mktemp("lora_run"), "actor.lora.rank=4", "actor.lora.alpha=8")


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


@contextlib.contextmanager
def one_process_group():
    from rlplat.controller.host import WorkerHost, free_port

    host = WorkerHost(rank=0, world_size=1)
    host.init_distributed("127.0.0.1", free_port(), use_gpu=False)
    try:
        yield
    finally:
        host.shutdown()


def engine_log_probs(run, batch: DataProto) -> torch.Tensor:
    """The trainer's engine, built from the run's config, after loading its last checkpoint."""
    config = OmegaConf.load(run / "config.yaml")
    with one_process_group():
        engine = EngineRegistry("engine").build(config.actor.engine, engine_node(config, "actor", 2))
        engine.init_model()
        engine.load(str(run / "checkpoints" / "global_step_2" / "actor"))
        return engine.forward(batch).batch["log_probs"]


def test_exports_a_model_that_transformers_loads_with_the_engines_log_probs(full_run, assets, tmp_path, cli_run, cli_in_process):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")
    refused = cli_in_process("export", str(full_run), "--out", str(out))
    assert refused.returncode == 2
    assert "exists and is not empty; pass --force" in refused.stderr
    # the installed command, as a user runs it; the run directory: its newest checkpoint
    result = cli_run("export", str(full_run), "--out", str(out), "--force")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert "global_step_2 (step 2)" in result.stderr
    assert not (out / "stale.txt").exists()
    assert [path.name for path in tmp_path.iterdir()] == ["exported"]  # no partial folder left beside it
    batch = scoring_batch()
    exported = hf_log_probs(AutoModelForCausalLM.from_pretrained(out).eval(), batch)
    assert (exported - engine_log_probs(full_run, batch)).abs().max() < TOLERANCE
    base = hf_log_probs(AutoModelForCausalLM.from_pretrained(assets["model"]).eval(), batch)
    assert (exported - base).abs().max() > 1e-3  # the trained weights, not the base model's
    tokenizer = AutoTokenizer.from_pretrained(out)  # `rlplat run model.path=<out>` needs it
    assert tokenizer("7+7=")["input_ids"] == arithmetic_tokenizer()("7+7=")["input_ids"]


def test_adapter_export_of_a_full_fine_tuning_run_is_refused(full_run, tmp_path, cli_in_process):
    result = cli_in_process("export", str(full_run), "--out", str(tmp_path / "adapter"), "--adapter")
    assert result.returncode == 2
    assert "without LoRA (actor.lora.rank=0" in result.stderr
    assert not (tmp_path / "adapter").exists()


def test_a_missing_or_incomplete_checkpoint_is_refused(full_run, tmp_path, cli_in_process):
    missing = cli_in_process("export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    incomplete = tmp_path / "run" / "checkpoints" / "global_step_3"
    incomplete.mkdir(parents=True)
    result = cli_in_process("export", str(incomplete), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "has no COMPLETE marker" in result.stderr
    empty = cli_in_process("export", str(tmp_path / "run"), "--out", str(tmp_path / "out"))
    assert empty.returncode == 2 and "holds no complete checkpoint" in empty.stderr


def test_a_run_without_its_config_is_refused(full_run, tmp_path, cli_in_process):
    shutil.copytree(full_run / "checkpoints", tmp_path / "run" / "checkpoints")
    result = cli_in_process("export", str(tmp_path / "run"), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert f"{tmp_path / 'run' / 'config.yaml'} does not exist" in result.stderr


@pytest.mark.skipif(not ENGINE_HAS_LORA, reason="the fsdp2 engine has no LoRA adapters (FSDP2Engine.supports_lora is False)")
def test_lora_exports_merged_and_as_an_adapter_peft_loads(lora_run, assets, tmp_path, cli_in_process):
    import peft
    from transformers import AutoModelForCausalLM

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    checkpoint = lora_run / "checkpoints" / "global_step_2"
    for arguments in (["--out", str(merged)], ["--out", str(adapter), "--adapter"]):
        result = cli_in_process("export", str(checkpoint), *arguments)
        assert result.returncode == 0, result.stderr
    batch = scoring_batch()
    trained = engine_log_probs(lora_run, batch)
    assert (hf_log_probs(AutoModelForCausalLM.from_pretrained(merged).eval(), batch) - trained).abs().max() < TOLERANCE
    with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["model"]), adapter).eval()
    assert (hf_log_probs(with_adapter, batch) - trained).abs().max() < TOLERANCE
    with with_adapter.disable_adapter():  # the adapter was trained: the base model differs
        assert (hf_log_probs(with_adapter, batch) - trained).abs().max() > 1e-3
    assert sorted(path.name for path in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_run_no_installed_command_wrote_is_refused(full_run, tmp_path, cli_in_process):
    shutil.copytree(full_run / "checkpoints", tmp_path / "run" / "checkpoints")
    config = OmegaConf.load(full_run / "config.yaml")
    config.evaluation = {"metric": "accuracy"}
    OmegaConf.save(config, tmp_path / "run" / "config.yaml")
    result = cli_in_process("export", str(tmp_path / "run"), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "is not the config of a run any installed command writes (rlplat run" in result.stderr
    assert "evaluation" in result.stderr.split("its top-level nodes are ")[1].split(" (")[0]
    assert not (tmp_path / "out").exists()
