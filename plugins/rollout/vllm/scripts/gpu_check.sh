#!/usr/bin/env bash
# The vllm rollout's GPU check, for a machine with one or more NVIDIA GPUs: builds the vllm environment
# (make), runs the plugin's gpu-marked tests (the rollout conformance suite in hybrid and server mode,
# weight updates, sleep and the staged wake-up), then three GRPO steps of the built-in demo task with the
# fsdp2 engine and the vllm rollout colocated on one GPU. Metrics land in $RUN_DIR/metrics.jsonl.
#
#   plugins/rollout/vllm/scripts/gpu_check.sh            # from anywhere in the repository
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
RUN_DIR=${RUN_DIR:-runs/gpu-check-vllm}

nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
make test-vllm-gpu PYTEST_ARGS="-v -rs"

export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
.venv-vllm/bin/rlplat run --algo grpo --engine fsdp2 --rollout vllm \
    trainer.total_training_steps=3 trainer.output_dir="$RUN_DIR" trainer.resume=disable trainer.test_freq=0 \
    cluster.use_gpu=true cluster.devices_per_node=1 \
    rollout.free_between_phases=true \
    rollout.config.gpu_memory_utilization=0.3 rollout.config.enforce_eager=true rollout.config.max_model_len=128

.venv-vllm/bin/python - "$RUN_DIR" <<'PY'
import json, sys
from pathlib import Path

rows = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines() if line.strip()]
steps = [row for row in rows if "critic/score/mean" in row or "actor/pg_loss" in row]
keys = ["step", "critic/score/mean", "actor/pg_loss", "rollout/log_prob_diff_max", "timing_s/generate", "timing_s/sync_weights"]
for row in steps:
    print("  ".join(f"{key}={row.get(key)}" for key in keys if key in row))
assert len(steps) >= 3, f"expected 3 training steps in the metrics, found {len(steps)}"
print("gpu check passed: 3 GRPO steps with the vllm rollout")
PY
