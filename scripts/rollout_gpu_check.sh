#!/usr/bin/env bash
# GPU check of a backend rollout plugin (vllm or sglang), for a machine with a CUDA GPU:
#   1. builds the backend's environment (make) and runs the plugin's gpu-marked tests: the rollout
#      conformance suite on a real engine in hybrid and server mode, weight updates, sleep and the staged
#      wake-up;
#   2. three GRPO steps, fsdp2 training engine + the backend's rollout colocated on one GPU, on a tiny
#      random-init Qwen2 made here and the demo's arithmetic prompts; prints each step's metrics.
#
#   scripts/rollout_gpu_check.sh vllm|sglang        (or: make gpu-check-vllm / make gpu-check-sglang)
#   OUT_DIR (default runs/gpu-check-BACKEND) receives the model, the run and its metrics.
set -euo pipefail
BACKEND=${1:?usage: scripts/rollout_gpu_check.sh vllm|sglang}
case "$BACKEND" in
    vllm) MEMORY=(rollout.config.gpu_memory_utilization=0.3 rollout.config.enforce_eager=true rollout.config.max_model_len=64) ;;
    sglang) MEMORY=(rollout.config.mem_fraction_static=0.3 rollout.config.context_length=64 rollout.config.engine_kwargs.attention_backend=triton) ;;
    *) echo "unknown backend '$BACKEND' (vllm or sglang)" >&2; exit 2 ;;
esac
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
VENV=.venv-$BACKEND
OUT_DIR=${OUT_DIR:-runs/gpu-check-$BACKEND}
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false

echo "== 1. gpu tests ($BACKEND)"
make "test-$BACKEND-gpu" PYTEST_ARGS="-v -rs"
"$VENV/bin/python" -c "import torch, $BACKEND; print('torch', torch.__version__, '$BACKEND', $BACKEND.__version__, torch.cuda.get_device_name())"

echo "== 2. GRPO, 3 steps, fsdp2 + $BACKEND"
mkdir -p "$OUT_DIR"
MODEL="$OUT_DIR/tiny-qwen2"
"$VENV/bin/python" -c "from rlplat.testing.tiny_models import save_tiny_model; save_tiny_model('$MODEL', seed=0)"
read -r TRAIN VAL < <("$VENV/bin/python" -c "
import rlplat_demo
print(rlplat_demo.train_file(), rlplat_demo.val_file())")

"$VENV/bin/rlplat" run --algo grpo --engine fsdp2 --rollout "$BACKEND" \
    model.path="$MODEL" "data.train_files=[$TRAIN]" "data.val_files=[$VAL]" \
    reward.scorer=exact_match \
    data.train_batch_size=16 data.max_prompt_length=16 \
    rollout.n=4 rollout.response_length=4 rollout.free_between_phases=true "${MEMORY[@]}" \
    actor.optim.lr=1e-4 actor.ppo_mini_batch_size=16 \
    trainer.total_training_steps=3 trainer.test_freq=0 trainer.save_freq=0 trainer.resume=disable trainer.overwrite=true \
    trainer.output_dir="$OUT_DIR/grpo" cluster.use_gpu=true cluster.devices_per_node=1

"$VENV/bin/python" - "$OUT_DIR/grpo" <<'PY'
import sys

from rlplat.trainer.tracking import read_metrics

steps = [row for row in read_metrics(sys.argv[1]) if "critic/score/mean" in row]
keys = ("step", "critic/score/mean", "actor/pg_loss", "rollout/log_prob_diff_max", "timing_s/generate", "timing_s/sync_weights", "timing_s/step")
for row in steps:
    print("  ".join(f"{key}={row[key]:.4g}" if isinstance(row[key], float) else f"{key}={row[key]}" for key in keys if key in row))
assert len(steps) >= 3, f"expected 3 training steps in {sys.argv[1]}, found {len(steps)}"
print("gpu check passed: 3 GRPO steps with the rollout")
PY
