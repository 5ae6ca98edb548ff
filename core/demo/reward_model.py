"""The demo's reward model: a scalar scorer of ``a+b=`` answers, trained on correct vs incorrect ones.

``python -m rlplat.demo.build --only reward-model`` (and the default ``--only all``) writes it to
``assets/reward_model/`` next to the arithmetic demo's policy, which it needs:

1. Initialisation: the warm-started policy (``assets/model``) loaded as
   ``AutoModelForSequenceClassification`` with one label, its score head drawn under the seed: the usual
   recipe (a reward model starts from the supervised policy) and the same tokenizer, so the reward-model
   role scores the policy's tokens without re-tokenising.
2. Data, per training prompt: the correct answer against incorrect ones of two kinds: the warm-started
   policy's own wrong samples (temperature 1, the mistakes RL will meet) and near misses of the sum
   (off by one or ten, a dropped or repeated digit, no EOS). Sequences are what the trainer scores:
   ``BOS a+b=`` then the answer tokens, the EOS when the answer has one.
3. Training: the Bradley-Terry loss ``-log sigmoid(r(correct) - r(incorrect))`` over those pairs (AdamW,
   batch :data:`BATCH_PROMPTS` prompts with :data:`NEGATIVES` incorrect answers each), for a fixed
   number of steps.
4. Measured on the validation prompts (never trained on): the share of pairs ranked right, and how often
   the answer the model ranks first among eight policy samples is correct when one of them is.

Deterministic under the seed on a given machine and torch build.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

BATCH_PROMPTS = 64
NEGATIVES = 4
POLICY_SAMPLES = 4
"""Samples drawn from the warm-started policy per prompt, from which its wrong answers are taken."""


def answer_ids(tokenizer: Any, text: str, eos: bool = True) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.eos_token_id] if eos else ids


def near_misses(a: int, b: int, rng: Any) -> list[tuple[str, bool]]:
    """Wrong answers close to ``a + b``: (text, ends with EOS)."""
    total = a + b
    text = str(total)
    misses = [str(total + delta) for delta in (-10, -1, 1, 10) if total + delta >= 0]
    if len(text) > 1:
        misses.append(text[:-1])                       # a dropped digit
        misses.append(text[1:] if text[1:] != text else text + "0")
    misses.append(text + text[-1])                      # a repeated digit
    misses.append(text[::-1] if text[::-1] != text else str(total + 2))
    answers = [(miss, True) for miss in misses if miss and miss != text]
    answers.append((text, False))                        # right digits, no EOS: not an answer
    return answers


def policy_samples(policy: Any, tokenizer: Any, pairs: Sequence[tuple[int, int]], *, samples: int,
                   seed: int, batch_prompts: int = 512) -> list[list[list[int]]]:
    """``samples`` answers (token ids, EOS included when generated) of the policy per pair, at temperature 1."""
    import torch

    generator_seed = seed
    out: list[list[list[int]]] = []
    policy.eval()
    with torch.no_grad():
        for start in range(0, len(pairs), batch_prompts):
            chunk = pairs[start: start + batch_prompts]
            prompts = tokenizer([f"{a}+{b}=" for a, b in chunk], return_tensors="pt", padding=True)
            torch.manual_seed(generator_seed + start)
            output = policy.generate(**prompts, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=4, num_return_sequences=samples,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            answers = output[:, prompts["input_ids"].shape[1]:].tolist()
            for row in range(len(chunk)):
                group = []
                for ids in answers[row * samples:(row + 1) * samples]:
                    if tokenizer.eos_token_id in ids:
                        ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
                    group.append([token for token in ids if token != tokenizer.pad_token_id])
                out.append(group)
    return out


def correct_ids(tokenizer: Any, a: int, b: int) -> list[int]:
    return answer_ids(tokenizer, str(a + b))


def pair_answers(tokenizer: Any, pairs: Sequence[tuple[int, int]], sampled: list[list[list[int]]],
                 seed: int) -> list[list[list[int]]]:
    """Per pair: the wrong answers to train against (the policy's wrong samples, deduplicated, then near misses)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for (a, b), group in zip(pairs, sampled):
        right = correct_ids(tokenizer, a, b)
        wrong = [ids for ids in group if ids and ids != right]
        wrong += [answer_ids(tokenizer, text, eos) for text, eos in near_misses(a, b, rng)]
        unique = list({tuple(ids): ids for ids in wrong}.values())
        out.append(unique)
    return out


def score_sequences(model: Any, tokenizer: Any, sequences: list[list[int]]) -> Any:
    """Scores of whole sequences (left-padded), read at each one's last token, with gradients."""
    import torch

    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence):] = torch.as_tensor(sequence)
        attention_mask[row, width - len(sequence):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    return model.score(hidden[:, -1]).squeeze(-1).float()


def prompt_ids(tokenizer: Any, a: int, b: int) -> list[int]:
    return tokenizer(f"{a}+{b}=")["input_ids"]


def evaluate(model: Any, tokenizer: Any, pairs: Sequence[tuple[int, int]], sampled: list[list[list[int]]]) -> dict[str, float]:
    """Pairwise accuracy (correct above each distinct wrong policy sample) and best-of-n agreement."""
    import torch

    ranked = total = best_right = solvable = 0
    model.eval()
    with torch.no_grad():
        for (a, b), group in zip(pairs, sampled):
            prompt, right = prompt_ids(tokenizer, a, b), correct_ids(tokenizer, a, b)
            candidates = [right] + list({tuple(ids): ids for ids in group if ids and ids != right}.values())
            scores = score_sequences(model, tokenizer, [prompt + ids for ids in candidates]).tolist()
            ranked += sum(scores[0] > other for other in scores[1:])
            total += len(scores) - 1
            if right in group:
                solvable += 1
                group_scores = score_sequences(model, tokenizer, [prompt + ids for ids in group]).tolist()
                best_right += group[max(range(len(group)), key=group_scores.__getitem__)] == right
    return {"pairwise_accuracy": ranked / max(total, 1), "best_of_n_correct": best_right / max(solvable, 1),
            "prompts_with_a_correct_sample": solvable / max(len(pairs), 1)}


def train(model: Any, tokenizer: Any, pairs: Sequence[tuple[int, int]], wrong: list[list[list[int]]], *,
          seed: int, steps: int, lr: float, log=print) -> list[dict[str, float]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50) * max(0.0, 1 - step / steps))
    history = []
    model.train()
    for step in range(1, steps + 1):
        rows = torch.randint(len(pairs), (BATCH_PROMPTS,), generator=generator).tolist()
        sequences, groups = [], []
        for row in rows:
            a, b = pairs[row]
            prompt = prompt_ids(tokenizer, a, b)
            choices = wrong[row]
            picks = torch.randint(len(choices), (NEGATIVES,), generator=generator).tolist()
            groups.append(len(sequences))
            sequences.append(prompt + correct_ids(tokenizer, a, b))
            sequences.extend(prompt + choices[pick] for pick in picks)
        scores = score_sequences(model, tokenizer, sequences).view(BATCH_PROMPTS, 1 + NEGATIVES)
        margin = scores[:, :1] - scores[:, 1:]
        loss = -torch.nn.functional.logsigmoid(margin).mean() + 1e-3 * scores.pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps:
            accuracy = float((margin > 0).float().mean())
            history.append({"step": step, "loss": loss.item(), "batch_pairwise_accuracy": accuracy})
            log(f"reward model step {step}: loss {loss.item():.4f}, batch pairwise accuracy {accuracy:.3f}")
    model.eval()
    return history


def build(out: Path, policy_dir: Path, train_pairs: Sequence[tuple[int, int]], val_pairs: Sequence[tuple[int, int]], *,
          seed: int = 0, steps: int = 1500, lr: float = 1e-3, log=print) -> dict[str, Any]:
    """Train the reward model from the policy in ``policy_dir`` and write it (with the tokenizer and
    ``build_info.json``) to ``out``; returns the build info."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    started = time.monotonic()
    out = Path(out)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    with torch.random.fork_rng():
        train_samples = policy_samples(policy, tokenizer, train_pairs, samples=POLICY_SAMPLES, seed=seed)
        val_samples = policy_samples(policy, tokenizer, val_pairs, samples=POLICY_SAMPLES, seed=seed + 1)
        wrong = pair_answers(tokenizer, train_pairs, train_samples, seed)
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1, dtype=torch.float32)
        before = evaluate(model, tokenizer, val_pairs, val_samples)
        history = train(model, tokenizer, train_pairs, wrong, seed=seed, steps=steps, lr=lr, log=log)
    after = evaluate(model, tokenizer, val_pairs, val_samples)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "command": f"python -m rlplat.demo.build --only reward-model --seed {seed}",
        "seed": seed,
        "initialised_from": "the warm-started arithmetic policy (model/), score head drawn under the seed",
        "loss": f"Bradley-Terry, the correct answer against {NEGATIVES} incorrect ones per prompt",
        "incorrect_answers": f"the policy's wrong samples ({POLICY_SAMPLES} per prompt, temperature 1) and near misses of the sum",
        "steps": steps, "batch_prompts": BATCH_PROMPTS, "lr": lr,
        "history": history,
        "val_before_training": before,
        "val": after,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "build_seconds": round(time.monotonic() - started, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
