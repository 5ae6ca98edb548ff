"""Token-in-token-out throughput of the hf rollout: 256 concurrent ``generate_tokens`` calls against one
batched ``generate`` of the same 256 prompts, in one process.

The model is the demo's (``rlplat_demo.model_dir()``, weights loaded, ``HFRollout`` with ``model_path``);
the prompts are the first 256 of the demo's training data, encoded as rlplat's data loader does (message
contents concatenated, BOS added: 7 tokens each). Sampling on every side: one sample per prompt,
temperature 1, no top-k / top-p, up to ``--max-new-tokens`` (16) new tokens, a response ending at the
model's EOS (the demo model answers ``ab+cd=`` with 2-3 digits and EOS, so most responses are 3-4
tokens; the table reports the tokens each side sampled, and tokens/s counts sampled tokens only).

- ``generate``: one ``rollout.generate`` of the 256 left-padded prompts (the trainer's path);
- ``generate_tokens``: 256 ``rollout.generate_tokens`` calls at once through ``asyncio.gather`` (an agent
  loop's path: the engine batches them continuously);
- ``generate_tokens, seeded``: the same, each call with its own ``sampling.seed`` (what training runs do: each
  row draws from its own counter-based stream, all seeded rows of a step in one batched draw);
- ``agent loops``: the 256 prompts as one batch through ``AgentLoopManager`` with the ``single_turn`` loop
  (one conversation per prompt, what a run with ``agent.loop=single_turn`` does in each worker);
- ``batch of one each``: what ``generate_tokens`` did before it batched: each call a ``generate`` of one
  prompt in a thread of asyncio's default executor (reference only).

Every side samples from the engine's generator unless seeded. Each repetition runs every contender once,
interleaved with the order rotating (``bench/measure.py``); the table shows medians, tokens/s is the
median of each repetition's tokens / seconds, and the last lines the ratios of ``generate_tokens`` and of
the agent loops to ``generate`` against the target >= 0.8x.

Another way of issuing the requests (an agent-loop manager, ...) is one more
``request_contender(name, generate_one, ...)`` with an ``async generate_one(prompt_ids, sampling)``.

Run: ``.venv/bin/python bench/agent_tokens.py [--repetitions 7] [--torch-threads 1] [--max-new-tokens 16]``
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
from typing import Awaitable, Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import Contender, describe_environment, parse_arguments, print_table, race  # noqa: E402

import rlplat_demo as demo  # noqa: E402
from rlplat.contracts.rollout import SamplingParams, TokenOutput  # noqa: E402
from rlplat.testing.rollouts import left_padded_prompts  # noqa: E402

PROMPTS = 256
TARGET = 0.8

GenerateOne = Callable[[Sequence[int], SamplingParams], Awaitable[TokenOutput]]


class TokenContender(Contender):
    """A contender whose every run reports how many tokens it sampled (``tokens``, one per run)."""

    def __init__(self, name: str, run: Callable[[], int]):
        super().__init__(name, lambda _: self.tokens.append(run()))
        self.tokens: list[int] = []

    def rates(self) -> list[float]:
        timed = self.tokens[len(self.tokens) - len(self.seconds):]  # the warm-up runs came first
        return [tokens / seconds for tokens, seconds in zip(timed, self.seconds)]


def request_contender(name: str, generate_one: GenerateOne, prompts: list[list[int]],
                      sampling_for: Callable[[int], SamplingParams]) -> TokenContender:
    """All ``prompts`` at once, ``await generate_one(prompt_ids, sampling_for(index))`` each, gathered in
    one event loop; a run counts the tokens of every output."""

    async def all_at_once() -> list[TokenOutput]:
        return await asyncio.gather(*(generate_one(prompt, sampling_for(index)) for index, prompt in enumerate(prompts)))

    return TokenContender(name, lambda: sum(len(output.token_ids) for output in asyncio.run(all_at_once())))


def demo_prompts(count: int) -> list[list[int]]:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir())
    rows = pq.read_table(demo.train_file()).to_pylist()[:count]
    return [tokenizer("".join(message["content"] for message in row["prompt"]))["input_ids"] for row in rows]


def main() -> None:
    import transformers

    from rlplat_rollout_hf.rollout import HFRollout

    args = parse_arguments(__doc__.splitlines()[0], repetitions=7, warmup=1)
    rollout = HFRollout({"model_path": str(demo.model_dir())})
    prompts = demo_prompts(PROMPTS)
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    batch = left_padded_prompts(prompts, rollout.pad_token_id)

    def batched_generate() -> int:
        return int(rollout.generate(batch, sampling).batch["response_mask"].sum())

    async def batch_of_one(prompt: Sequence[int], one: SamplingParams) -> TokenOutput:
        out = await asyncio.to_thread(rollout.generate, left_padded_prompts([list(prompt)], rollout.pad_token_id), one)
        length = int(out.batch["response_mask"][0].sum())
        return TokenOutput(out.batch["responses"][0, :length].tolist(), out.batch["rollout_log_probs"][0, :length].tolist(), "")

    generate = TokenContender("generate (one batch of 256)", batched_generate)
    tokens = request_contender("generate_tokens (256 concurrent)", rollout.generate_tokens, prompts, lambda _: sampling)
    seeded = request_contender("generate_tokens, seeded", rollout.generate_tokens, prompts,
                               lambda index: SamplingParams(max_new_tokens=16, temperature=1.0, seed=index))
    one_each = request_contender("batch of one each (before)", batch_of_one, prompts, lambda _: sampling)
    from rlplat_agents.config import AgentConfig
    from rlplat_agents.manager import AgentLoopManager, EngineClient
    from transformers import AutoTokenizer

    manager = AgentLoopManager([EngineClient(rollout)], AutoTokenizer.from_pretrained(demo.model_dir()),
                               AgentConfig(loop="single_turn"), pad_token_id=rollout.pad_token_id,
                               max_prompt_length=batch.batch["input_ids"].shape[1])
    agents = TokenContender("agent loops (single_turn, 256 conversations)",
                            lambda: int(manager.generate(batch, sampling, sampling.max_new_tokens).batch["response_mask"].sum()))
    contenders = [generate, tokens, agents, seeded, one_each]
    race(contenders, args.repetitions, args.warmup, budget_s=0.0)

    reference = statistics.median(generate.rates())
    rows = []
    for contender in contenders:
        rate = statistics.median(contender.rates())
        timed_tokens = contender.tokens[len(contender.tokens) - len(contender.seconds):]
        rows.append([contender.name, f"{contender.median_ms:.1f}", f"{statistics.median(timed_tokens):.0f}",
                     f"{rate:,.0f}", f"{rate / reference:.2f}x"])
    print_table(
        f"hf rollout, demo model, {PROMPTS} prompts x 1 sample, temperature 1, up to {sampling.max_new_tokens} new tokens "
        f"(median of {len(generate.seconds)} interleaved repetitions)",
        ["contender", "ms", "tokens", "tokens/s", "vs generate"], rows,
        notes=[describe_environment({"transformers": transformers.__version__})],
    )
    for name, contender in (("generate_tokens", tokens), ("agent loops", agents)):
        ratio = statistics.median(contender.rates()) / reference
        print(f"\n{name} / generate tokens/s: {ratio:.2f}x (target >= {TARGET}x: {'met' if ratio >= TARGET else 'NOT met'})", end="")
    print()


if __name__ == "__main__":
    main()
