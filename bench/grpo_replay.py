"""Does rlplat's demo step update the model exactly as the plain loop's step does? Replay rlplat's own batches
through ``bench/plain_grpo.py``'s ``grpo_step`` and compare the two models after every step.

1. ``rlplat run --demo arith`` for ``--steps`` steps with ``trainer.rollout_dump_dir`` (every step's generated
   and scored batch, with the rollout's log-probs of its sampled tokens) and ``trainer.seed``/``data.seed``.
2. The plain loop starts from the same shipped model and, for each step k, takes rlplat's batch k (its prompts,
   responses, masks and scores), computes GRPO's advantages from the scores by ``uid`` group and runs its own
   ``grpo_step`` (AdamW at the demo's learning rate, clip 1.0), the lr scheduled as rlplat schedules it.
3. Before step k+1, rlplat's rollout sampled batch k+1 from the weights after k updates and recorded the
   log-probability of every sampled token. The plain model after its k replayed updates scores the same
   tokens; the two agree only if the k updates agree. The script prints, per step, the largest absolute
   difference over the batch's response tokens, and the mean.

The rollout samples at temperature 1 with no filter, so its log-probs are ``log_softmax`` of the logits, what
the plain model computes. float32 throughout; both run on this machine's CPU with 2 threads (rlplat's step
in one process, ``cluster.backend=local``, as the demo runs). Differences of float32 rounding (1e-6 after a
step) grow through Adam's normalisation; a different algorithm (another lr, aggregation, clipping,
advantage, old log-probs) shows as 1e-3 or more within a few steps.

Run: python bench/grpo_replay.py [--steps 50] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plain_grpo  # noqa: E402


def run_rlplat(steps: int, seed: int, output: Path, extra: list[str]) -> None:
    rlplat = Path(sys.executable).with_name("rlplat")
    launcher = [str(rlplat)] if rlplat.exists() else [sys.executable, "-c", "from rlplat.cli.main import main; main()"]
    command = [*launcher, "run", "--demo", "arith", f"trainer.total_training_steps={steps}",
               f"trainer.rollout_dump_dir={output / 'dump'}", f"trainer.output_dir={output / 'run'}",
               "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[console]",
               "trainer.resume=disable", f"trainer.seed={seed}", f"data.seed={seed}", *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"rlplat run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def load_batch(path: Path) -> dict:
    from rlplat.trainer.rollout_dump import read_batch

    batch = read_batch(path)
    prompts = batch.batch["prompts"]
    return {
        "ids": prompts,
        "mask": batch.batch["attention_mask"][:, : prompts.shape[1]],
        "responses": batch.batch["responses"],
        "response_mask": batch.batch["response_mask"],
        "rollout_log_probs": batch.batch["rollout_log_probs"],
        "scores": batch.batch["token_level_scores"].sum(-1),
        "uids": list(batch.non_tensor_batch["uid"]),
    }


def grpo_advantages(scores: torch.Tensor, uids: list, epsilon: float = 1e-6) -> torch.Tensor:
    """(score - group mean) / (unbiased group std + epsilon), a group per uid."""
    groups = defaultdict(list)
    for row, uid in enumerate(uids):
        groups[uid].append(row)
    advantages = torch.zeros_like(scores)
    for rows in groups.values():
        values = scores[rows]
        std = values.std() if len(rows) > 1 else torch.tensor(1.0)
        advantages[rows] = (values - values.mean()) / (std + epsilon)
    return advantages


@torch.no_grad()
def log_probs(model, batch: dict) -> torch.Tensor:
    ids, mask, responses, response_mask = batch["ids"], batch["mask"], batch["responses"], batch["response_mask"]
    sequence = torch.cat([ids, responses], dim=1)
    attention = torch.cat([mask, response_mask], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequence, attention_mask=attention, position_ids=positions).logits
    return torch.log_softmax(logits[:, ids.shape[1] - 1:-1].float(), -1).gather(-1, responses[..., None]).squeeze(-1)


def demo_setting(key: str) -> str:
    from rlplat_demo import overrides

    return next(item.split("=", 1)[1] for item in overrides() if item.startswith(key + "="))


def cosine_factor(step: int, total: int, min_ratio: float) -> float:
    """rlplat's cosine schedule without warm-up: the lr factor of optimizer step ``step`` (from 0)."""
    progress = min(step / max(total, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="an rlplat override (repeatable)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rlplat_demo as demo

    with tempfile.TemporaryDirectory(prefix="bench-grpo-replay-") as tmp:
        output = Path(tmp)
        run_rlplat(args.steps, args.seed, output, args.override)
        batches = [load_batch(output / "dump" / f"step_{step:06d}.parquet") for step in range(1, args.steps + 1)]

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(demo.model_dir(), dtype=torch.float32)
    model.train()
    lr = float(demo_setting("actor.optim.lr"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    scheduled = demo_setting("actor.optim.lr_scheduler_type") == "cosine"
    min_ratio = float(demo_setting("actor.optim.min_lr_ratio"))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_factor(s, args.steps, min_ratio) if scheduled else 1.0)

    rows, largest, means, differing = [], [], [], []
    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir())
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for step, batch in enumerate(batches, start=1):
        mask = batch["response_mask"].bool()
        difference = (log_probs(model, batch) - batch["rollout_log_probs"]).abs()[mask]
        largest.append(float(difference.max()))
        means.append(float(difference.mean()))
        model.eval()
        drawn, drawn_mask = plain_grpo.sample(model, batch["ids"], batch["mask"], batch["responses"].shape[1], eos, pad,
                                              plain_grpo.RowStreams(args.seed * 1_000_003 + step, len(batch["ids"])))
        width = drawn.shape[1]
        same_rows = ((drawn == batch["responses"][:, :width]) | ~batch["response_mask"][:, :width].bool()).all(-1)
        same_rows &= (drawn_mask == batch["response_mask"][:, :width]).all(-1) & (batch["response_mask"][:, width:] == 0).all(-1)
        differing.append(int((~same_rows).sum()))
        rows.append((step, step - 1, largest[-1], means[-1], differing[-1], float(batch["scores"].mean())))
        model.train()
        plain_grpo.grpo_step(model, optimizer, batch["ids"], batch["mask"], batch["responses"], batch["response_mask"],
                             grpo_advantages(batch["scores"], batch["uids"]))
        schedule.step()

    print(f"rlplat's demo batches (seed {args.seed}, {args.steps} steps) replayed through the plain loop's step")
    print("| batch | plain updates before it | max abs log-prob difference | mean | rows the plain sampler draws differently | batch reward |")
    print("| --- | --- | --- | --- | --- | --- |")
    for step, updates, big, mean, rows_differ, reward in rows:
        if step <= 5 or step % 10 == 0 or step == len(rows):
            print(f"| {step} | {updates} | {big:.2e} | {mean:.2e} | {rows_differ} of {len(batches[0]['uids'])} | {reward:.3f} |")
    print(f"max abs log-prob difference over all {len(rows)} batches: {max(largest):.2e} "
          f"(median per batch {statistics.median(largest):.2e}); batch 1 (no update yet) {largest[0]:.2e}")
    print(f"the plain loop's sampler with rlplat's streams (plain_grpo.RowStreams), from the replayed weights: "
          f"{sum(differing)} of {sum(len(b['uids']) for b in batches)} rows differ from rlplat's")


if __name__ == "__main__":
    main()
