"""The demo's reward model: a scalar scorer of ``a+b=`` answers, trained on correct vs incorrect ones.

``python -m rlplat_demo.build --only reward-model`` (and the default ``--only all``) writes it to
``assets/reward_model/`` next to the arithmetic demo's policy, which it needs:

1. Initialisation: the warm-started policy (``assets/model``), trained further by the same supervised
   steps until its greedy validation accuracy reaches ``trunk_threshold`` (a verifier must compute the sum
   more reliably than the policy it judges), then loaded as ``AutoModelForSequenceClassification`` with
   one label, its score head drawn under the seed: the usual recipe (a reward model starts from a
   supervised model) and the same tokenizer, so the reward-model role scores the policy's tokens as they are.
2. Data, per training prompt: the correct answer against incorrect ones of two kinds: the warm-started
   policy's own wrong samples (temperature 1, the mistakes RL will meet) and near misses of the sum
   (off by one or ten, a dropped or repeated digit, no EOS). Sequences are what the trainer scores:
   ``BOS a+b=`` then the answer tokens, the EOS when the answer has one.
3. Training: the Bradley-Terry loss ``-log sigmoid(r(correct) - r(incorrect))`` over those pairs, plus
   the next-token loss on the correct answers (:func:`answer_loss`) so the trunk keeps computing sums
   (AdamW, batch :data:`BATCH_PROMPTS` prompts with :data:`NEGATIVES` incorrect answers each), for a fixed
   number of steps.
4. Measured on the validation prompts (never trained on): the share of pairs ranked right, how often
   the answer the model ranks first among the policy's samples is correct when one of them is, and how
   often the best-scored of all answers 0..199 is the right one (what a policy maximising it converges to).

Deterministic under the seed on a given machine and torch build.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from rlplat_demo.build import warm_start

BATCH_PROMPTS = 64
NEGATIVES = 4
POLICY_SAMPLES = 4
ANSWER_LOSS_WEIGHT = 1.0
"""Weight of the next-token loss on the correct answers, trained with the pairs (see :func:`answer_loss`)."""
"""Samples drawn from the warm-started policy per prompt, from which its wrong answers are taken."""


def answer_ids(tokenizer: Any, text: str, eos: bool = True) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.eos_token_id] if eos else ids


def near_misses(a: int, b: int) -> list[tuple[str, bool]]:
    """Wrong answers close to ``a + b``, as (text, ends with EOS): every sum off by 1 to 3 or by 10, a
    dropped, repeated or swapped digit, and the right digits without EOS (not a finished answer)."""
    total = a + b
    text = str(total)
    misses = [str(total + delta) for delta in (-10, -3, -2, -1, 1, 2, 3, 10) if total + delta >= 0]
    if len(text) > 1:
        misses += [text[:-1], text[1:], text[::-1]]
    misses.append(text + text[-1])
    answers = [(miss, True) for miss in dict.fromkeys(misses) if miss and miss != text]
    answers.append((text, False))
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


def pair_answers(tokenizer: Any, pairs: Sequence[tuple[int, int]], sampled: list[list[list[int]]]) -> list[list[list[int]]]:
    """Per pair: the wrong answers to train against (the policy's wrong samples, deduplicated, then near misses)."""
    out = []
    for (a, b), group in zip(pairs, sampled):
        right = correct_ids(tokenizer, a, b)
        wrong = [ids for ids in group if ids and ids != right]
        wrong += [answer_ids(tokenizer, text, eos) for text, eos in near_misses(a, b)]
        unique = list({tuple(ids): ids for ids in wrong}.values())
        out.append(unique)
    return out


def padded(tokenizer: Any, sequences: list[list[int]]) -> tuple[Any, Any, Any]:
    """``(input_ids, attention_mask, position_ids)`` of ``sequences`` left-padded to one width."""
    from rlplat.kits.data import left_padded

    tensors = left_padded(sequences, tokenizer.pad_token_id)
    return tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"]


def score_sequences(model: Any, tokenizer: Any, sequences: list[list[int]], *, with_hidden: bool = False) -> Any:
    """Scores of whole sequences (left-padded), read at each one's last token, with gradients (and the
    last hidden states when ``with_hidden``)."""
    input_ids, attention_mask, position_ids = padded(tokenizer, sequences)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    scores = model.score(hidden[:, -1]).squeeze(-1).float()
    return (scores, hidden, input_ids) if with_hidden else scores


def answer_loss(model: Any, hidden: Any, input_ids: Any, answer_lengths: list[int]) -> Any:
    """Next-token loss on each row's answer (its last ``answer_lengths[row]`` tokens) through the tied
    embeddings: keeps the trunk computing sums while the score head learns to compare."""
    import torch

    logits = hidden[:, :-1] @ model.model.embed_tokens.weight.T
    labels = torch.full_like(input_ids[:, 1:], -100)
    width = input_ids.shape[1]
    for row, length in enumerate(answer_lengths):
        labels[row, width - 1 - length:] = input_ids[row, width - length:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


def prompt_ids(tokenizer: Any, a: int, b: int) -> list[int]:
    return tokenizer(f"{a}+{b}=")["input_ids"]


def evaluate(model: Any, tokenizer: Any, pairs: Sequence[tuple[int, int]], sampled: list[list[list[int]]]) -> dict[str, float]:
    """Pairwise accuracy (correct above each distinct wrong policy sample), best-of-n agreement, and how
    often the best-scored of all 400 answers 0..199 (with and without EOS) is the right one: what a policy
    that maximises the score converges to."""
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
        everything = [(str(value), eos) for value in range(0, 200) for eos in (True, False)]
        top_right = 0
        for a, b in pairs:
            prompt = prompt_ids(tokenizer, a, b)
            scores = score_sequences(model, tokenizer, [prompt + answer_ids(tokenizer, text, eos) for text, eos in everything])
            top_right += everything[int(scores.argmax())] == (str(a + b), True)
    return {"pairwise_accuracy": ranked / max(total, 1), "best_of_n_correct": best_right / max(solvable, 1),
            "prompts_with_a_correct_sample": solvable / max(len(pairs), 1),
            "top_of_all_answers_correct": top_right / max(len(pairs), 1)}


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
        scores, hidden, input_ids = score_sequences(model, tokenizer, sequences, with_hidden=True)
        scores = scores.view(BATCH_PROMPTS, 1 + NEGATIVES)
        margin = scores[:, :1] - scores[:, 1:]
        lengths = [len(correct_ids(tokenizer, *pairs[row])) for row in rows]
        loss = (-torch.nn.functional.logsigmoid(margin).mean() + 1e-3 * scores.pow(2).mean()
                + ANSWER_LOSS_WEIGHT * answer_loss(model, hidden[groups], input_ids[groups], lengths))
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
          seed: int = 0, steps: int = 800, lr: float = 1e-3, trunk_threshold: float = 0.9, log=print) -> dict[str, Any]:
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
        wrong = pair_answers(tokenizer, train_pairs, train_samples)
        torch.manual_seed(seed)
        trunk_history = warm_start(policy, tokenizer, train_pairs, val_pairs, seed=seed, threshold=trunk_threshold,
                                   eval_every=50, max_steps=4000, log=log)
        with tempfile.TemporaryDirectory() as trunk:
            policy.save_pretrained(trunk)
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(trunk, num_labels=1, dtype=torch.float32)
        before = evaluate(model, tokenizer, val_pairs, val_samples)
        history = train(model, tokenizer, train_pairs, wrong, seed=seed, steps=steps, lr=lr, log=log)
    after = evaluate(model, tokenizer, val_pairs, val_samples)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "command": f"python -m rlplat_demo.build --only reward-model --seed {seed}",
        "seed": seed,
        "initialised_from": (f"the warm-started arithmetic policy (model/), further supervised to greedy validation accuracy "
                             f"{trunk_history[-1]['val_accuracy']:.3f} ({trunk_history[-1]['step']} steps); score head drawn under the seed"),
        "trunk_history": trunk_history,
        "loss": (f"Bradley-Terry, the correct answer against {NEGATIVES} incorrect ones per prompt, plus "
                 f"{ANSWER_LOSS_WEIGHT} x next-token loss on the correct answer"),
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
