#!/usr/bin/env bash
# The sglang rollout's GPU checks, on a machine with a CUDA GPU and the sglang environment:
#   1. the gpu-marked tests (the conformance suite with a real SGLang engine, hybrid and server mode);
#   2. a 3-step GRPO run: fsdp2 training engine + sglang rollout, colocated on one GPU, on a tiny
#      random-init Qwen2 and the demo's arithmetic prompts (what is checked: the loop runs, weights
#      sync into SGLang through sleep / staged wake-up, metrics are written).
#
# Usage, from the repository root:   plugins/rollout/sglang/scripts/gpu_check.sh
# Environment: PY (default .venv-sglang/bin/python, made by `make test-sglang`), OUT_DIR (default
# runs/sglang-gpu-check).
set -euo pipefail

cd "$(dirname "$0")/../../../.."
PY=${PY:-.venv-sglang/bin/python}
OUT_DIR=${OUT_DIR:-runs/sglang-gpu-check}
mkdir -p "$OUT_DIR"

"$PY" -c "import torch, sglang; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'sglang', sglang.__version__, torch.cuda.get_device_name())"

# the training side of the run (their dependencies are rlplat's own, already in the environment)
"$PY" -m pip install --quiet --no-deps -e plugins/rollout/sglang -e plugins/engines/fsdp2 -e plugins/algorithms/core -e plugins/rewards/core

echo "== 1. gpu tests"
"$PY" -m pytest -m gpu plugins/rollout/sglang/tests -p no:cacheprovider -v -rs

echo "== 2. GRPO, 3 steps, fsdp2 + sglang"
MODEL="$OUT_DIR/tiny-qwen2"
"$PY" -c "from rlplat.testing.tiny_models import save_tiny_model; save_tiny_model('$MODEL', seed=0)"
read -r TRAIN VAL SCORER < <("$PY" -c "
from pathlib import Path
from rlplat import demo
from rlplat.demo import scorer
print(demo.train_file(), demo.val_file(), Path(scorer.__file__))")

RAY_AUTH_MODE=disabled "$(dirname "$PY")/rlplat" run --algo grpo --engine fsdp2 --rollout sglang \
    model.path="$MODEL" \
    "data.train_files=[$TRAIN]" "data.val_files=[$VAL]" \
    reward.custom_function.path="$SCORER" reward.custom_function.name=exact_match \
    data.train_batch_size=16 data.max_prompt_length=16 \
    rollout.n=4 rollout.response_length=4 rollout.temperature=1.0 rollout.free_between_phases=true \
    rollout.config.mem_fraction_static=0.3 rollout.config.context_length=64 \
    rollout.config.engine_kwargs.attention_backend=triton \
    actor.optim.lr=1e-4 actor.ppo_mini_batch_size=16 actor.micro_batch_size_per_gpu=64 \
    actor.loss.use_kl_loss=false \
    trainer.total_training_steps=3 trainer.test_freq=0 trainer.save_freq=0 \
    trainer.output_dir="$OUT_DIR/grpo" \
    cluster.use_gpu=true cluster.devices_per_node=1

"$PY" - "$OUT_DIR/grpo/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [row for row in rows if "critic/score/mean" in row]
assert len(steps) >= 3, f"expected 3 training steps in {sys.argv[1]}, found {len(steps)}"
for row in steps:
    print({key: row.get(key) for key in ("step", "critic/score/mean", "actor/pg_loss", "response_length/mean", "timing_s/gen", "rollout/log_prob_diff_mean") if key in row})
print("sglang GPU check: OK")
PYEOF
