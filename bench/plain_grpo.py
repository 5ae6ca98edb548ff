"""A plain single-process PyTorch GRPO loop on the built-in demo: the hand-written baseline.

No rlplat trainer, no Ray, no FSDP: transformers' model, a token loop with the KV cache, and AdamW. Only
the demo's asset paths (``rlplat_demo``) and its reward (``rlplat.scorers.exact_match``) come from rlplat.
The recipe is the demo's (``rlplat_demo.overrides()``): per step 32 prompts (a seeded order per epoch,
``numpy.random.default_rng((seed, epoch)).permutation``, the short tail dropped, as rlplat's loader) x 8
samples, up to 4 new tokens (stop at EOS), temperature 1, no top-k / top-p; reward 1/0 exact match;
advantage ``(score - group mean) / (unbiased group std + 1e-6)``; PPO clipped surrogate (clip 0.2, one
epoch, old log-probs = the detached current ones, so ratio 1), token-mean over the batch, no KL; AdamW
lr 1e-4 (betas 0.9/0.999, eps 1e-8, no weight decay), gradient norm clipped at 1.0; float32.

Validation is rlplat's rule (``Trainer.validate``): greedy decode of up to 4 new tokens for every prompt of
``val.parquet`` in one batch, correct when the exact-match score is > 0. It runs before the first step and
every ``val_every`` steps; its times are when each validation ends, counted from the end of the first one
(rlplat's ``metrics.jsonl`` stamps a record when it is written, after that step's validation).

Run: python bench/plain_grpo.py [--steps 30] [--threads 2] [--val-every 10] [--seed 0] [--lr 1e-4 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlplat_demo as demo
from rlplat.scorers import exact_match


def load_prompts(path, tokenizer) -> tuple[list[list[int]], list[str]]:
    """rlplat's encoding of the demo (no chat template): message contents concatenated, BOS added."""
    rows = pq.read_table(path).to_pylist()
    ids = [tokenizer("".join(m["content"] for m in row["prompt"]))["input_ids"] for row in rows]
    return ids, [str(row["reward_model"]["ground_truth"]) for row in rows]


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


GAMMA = np.uint64(0x9E3779B97F4A7C15)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (uint64 arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class RowStreams:
    """A random stream per row, the scheme rlplat's hf rollout uses for a seeded call: row ``i``'s token ``t`` is
    the inverse CDF of its distribution at uniform ``u_t`` of the SplitMix64 sequence keyed by
    ``mix64(mix64(seed) + i * gamma)``. With rlplat's step seed (``trainer.seed * 1_000_003 + step``) the plain
    loop draws the very numbers rlplat's rollout draws for the same rows, so the two samplers can differ only
    where float rounding of the probabilities moves a token boundary past a uniform."""

    def __init__(self, seed: int, rows: int):
        base = mix64(np.array([seed % 2**64], dtype=np.uint64))
        self.keys = mix64(base + np.arange(rows, dtype=np.uint64) * GAMMA)

    def draw(self, probabilities: torch.Tensor, step: int) -> torch.Tensor:
        uniforms = (mix64(self.keys + np.array(step + 1, dtype=np.uint64) * GAMMA) >> np.uint64(11)).astype(np.float64) * 2.0**-53
        cumulative = probabilities.double().cumsum(-1)
        targets = torch.from_numpy(uniforms)[:, None] * cumulative[:, -1:]
        return torch.searchsorted(cumulative, targets, right=True).squeeze(-1).clamp(max=probabilities.shape[-1] - 1)


@torch.no_grad()
def sample(model, ids, mask, new_tokens, eos, pad, generator=None):
    """Token by token with the KV cache; greedy when ``generator`` is None, each row from its own stream when
    it is a :class:`RowStreams`, else ``torch.multinomial`` from the ``torch.Generator``. Returns responses
    [B, T] and their mask [B, T] (1 up to and including the first EOS)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    responses = torch.full((ids.shape[0], new_tokens), pad)
    response_mask = torch.zeros(ids.shape[0], new_tokens, dtype=torch.long)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    position = positions[:, -1:]
    for step in range(new_tokens):
        logits = out.logits[:, -1, :].float()
        if generator is None:
            tokens = logits.argmax(-1)
        elif isinstance(generator, RowStreams):
            tokens = generator.draw(torch.log_softmax(logits, -1).exp(), step)
        else:
            tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)
        responses[:, step] = torch.where(finished, pad, tokens)
        response_mask[:, step] = (~finished).long()
        finished |= tokens == eos
        if finished.all() or step == new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = position + 1
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=position,
                    past_key_values=out.past_key_values, use_cache=True)
    return responses, response_mask


def scores(tokenizer, responses, response_mask, answers) -> torch.Tensor:
    texts = tokenizer.batch_decode([r[: int(m.sum())].tolist() for r, m in zip(responses, response_mask)],
                                   skip_special_tokens=True)
    return torch.tensor([exact_match("arith", t, a)["score"] for t, a in zip(texts, answers)])


def validate(model, tokenizer, val_ids, val_answers, new_tokens=4) -> float:
    model.eval()
    responses, mask = sample(model, *left_pad(val_ids, tokenizer.pad_token_id), new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)
    model.train()
    return int((scores(tokenizer, responses, mask, val_answers) > 0).sum()) / len(val_answers)  # exact: count / rows


def grpo_step(model, optimizer, ids, mask, responses, response_mask, advantages, clip=0.2) -> float:
    """One clipped-surrogate update, token-mean over the batch (old log-probs = detached current)."""
    sequence = torch.cat([ids, responses], dim=1)
    attention = torch.cat([mask, response_mask], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequence, attention_mask=attention, position_ids=positions).logits
    log_probs = torch.log_softmax(logits[:, ids.shape[1] - 1:-1].float(), -1).gather(-1, responses[..., None]).squeeze(-1)
    ratio = torch.exp(log_probs - log_probs.detach())
    advantage = advantages[:, None]
    loss = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - clip, 1 + clip))
    weight = response_mask.float()
    loss = (loss * weight).sum() / weight.sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def run(steps: int, seed: int = 0, threads: int = 2, val_every: int | None = None, time_budget: float | None = None,
        lr: float = 1e-4, prompts: int = 32, samples: int = 8, warmup_steps: int = 0, new_tokens: int = 4,
        stop_at: float | None = None, verbose: bool = False, streams: bool = False) -> dict:
    """Train up to ``steps`` steps; stop early when ``time_budget`` seconds have passed since the end of the
    first validation (or since the start, without validation) or when validation accuracy reaches
    ``stop_at``. ``warmup_steps``: linear lr warm-up from 0 over that many steps, then constant. ``streams``:
    sample step ``s`` from :class:`RowStreams` seeded ``seed * 1_000_003 + s`` (rlplat's rollout's numbers)
    instead of ``torch.multinomial`` from one generator seeded ``seed``."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir())
    model = AutoModelForCausalLM.from_pretrained(demo.model_dir(), dtype=torch.float32)
    model.train()  # dropout is 0 in the demo config; train mode as rlplat's actor
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
    train_ids, train_answers = load_prompts(demo.train_file(), tokenizer)
    val_ids, val_answers = load_prompts(demo.val_file(), tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    per_epoch = len(train_ids) // prompts

    result = {"step_s": [], "gen_s": [], "train_s": [], "reward": [], "val": [], "steps": 0, "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    if val_every:
        accuracy = validate(model, tokenizer, val_ids, val_answers, new_tokens)
        t0 = time.perf_counter()
        result["val"].append((0.0, 0, accuracy))
    for step in range(1, steps + 1):
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            break
        started = time.perf_counter()
        epoch, position = divmod(step - 1, per_epoch)
        order = np.random.default_rng((seed, epoch)).permutation(len(train_ids))
        chosen = order[position * prompts:(position + 1) * prompts].tolist()
        group_ids = [train_ids[i] for i in chosen for _ in range(samples)]
        answers = [train_answers[i] for i in chosen for _ in range(samples)]
        ids, mask = left_pad(group_ids, pad)
        draws = RowStreams(seed * 1_000_003 + step, len(group_ids)) if streams else generator
        responses, response_mask = sample(model, ids, mask, new_tokens, eos, pad, draws)
        reward = scores(tokenizer, responses, response_mask, answers)
        grouped = reward.view(prompts, samples)
        advantages = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).view(-1)
        generated = time.perf_counter()
        grpo_step(model, optimizer, ids, mask, responses, response_mask, advantages)
        schedule.step()
        ended = time.perf_counter()
        result["step_s"].append(ended - started)
        result["gen_s"].append(generated - started)
        result["train_s"].append(ended - generated)
        result["reward"].append(float(reward.mean()))
        result["steps"] = step
        if val_every and step % val_every == 0:
            accuracy = validate(model, tokenizer, val_ids, val_answers, new_tokens)
            result["val"].append((time.perf_counter() - t0, step, accuracy))
            if verbose:
                print(f"step {step}: val acc {accuracy:.3f} at {result['val'][-1][0]:.1f} s, reward {reward.mean():.3f}", flush=True)
            if stop_at is not None and accuracy >= stop_at:
                break
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: never)")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds of training after the first validation")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lr-warmup", type=int, default=0, help="linear lr warm-up steps")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--streams", action="store_true", help="draw rlplat's rollout's per-row random numbers")
    args = parser.parse_args()
    result = run(args.steps, args.seed, args.threads, args.val_every or None, args.time_budget, lr=args.lr,
                 prompts=args.prompts, samples=args.samples, warmup_steps=args.lr_warmup, verbose=True,
                 streams=args.streams)
    timed = slice(args.warmup, None) if result["steps"] > args.warmup else slice(None)
    median = statistics.median(result["step_s"][timed])
    print(f"plain PyTorch GRPO, {args.prompts} prompts x {args.samples} samples, lr {args.lr:g}, {result['threads']} threads: "
          f"{result['steps']} steps, median {median:.3f} s/step (generation {statistics.median(result['gen_s'][timed]):.3f} s, "
          f"update {statistics.median(result['train_s'][timed]):.3f} s), mean reward of the last 10 steps "
          f"{statistics.fmean(result['reward'][-10:]):.3f}")
    for seconds, step, accuracy in result["val"]:
        print(f"  validation at step {step}: {accuracy:.3f} ({seconds:.1f} s after the first)")


if __name__ == "__main__":
    main()
