"""Throughput of the OpenAI-compatible gateway: 256 concurrent sessions through the stock ``openai`` client
against 256 concurrent ``generate_tokens`` calls of the same prompts on the hf rollout, in one process.

The model is the tool demo's (``rlplat_demo.tools.model_dir()``: a chat template, 114 tokens); the prompts
are the first 256 questions of its training data (``a*b=``), each rendered with the chat template and the
calculator offered, exactly as the gateway renders a request (22 tokens). Sampling on both sides: one
sample per prompt, temperature 1, up to ``--max-new-tokens`` (32) new tokens, a turn ending at
``<|im_end|>``; tokens/s counts sampled tokens only.

- ``generate_tokens``: 256 ``rollout.generate_tokens`` calls at once through ``asyncio.gather`` with the
  rendered prompt ids (the native agent loops' path: the engine batches them continuously);
- ``gateway (openai client)``: 256 sessions opened on the gateway, then one ``chat.completions.create``
  per session at once from an ``AsyncOpenAI`` client (HTTP on loopback: the request rendered with the
  template, tokenised, sampled through the same engine, recorded, its tool calls parsed, the reply
  serialised), then the sessions closed; the tokens counted are the recorded ones.

- ``gateway, aiohttp client``: the same requests from a plain ``aiohttp`` session: what the gateway
  costs without the ``openai`` client's own work (pydantic models, its connection pool).

Two models: the tool demo's (0.5M parameters: a decode step is so cheap that HTTP is most of the cost) and
the same shapes widened with random weights (``--hidden-size`` 384, ``--layers`` 6: 11M parameters, where a
decode step costs what a small real model's does on this CPU). torch runs ``--torch-threads`` threads on
both sides, by default the cores less one: the server and the clients need a core, and an OpenMP team
spinning on every core starves them (measured on 2 cores: the gateway at 0.2-0.5x with 2 torch threads,
noise-dominated).

Each repetition runs the three once, interleaved with the order rotating (``bench/measure.py``); the table
shows medians, and the last lines the ratio of the gateway's tokens/s with the ``openai`` client to
``generate_tokens``' against the target >= 0.8x.

Run: ``.venv/bin/python bench/gateway_tokens.py [--repetitions 3] [--max-new-tokens 64] [--torch-threads 1]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import describe_environment, print_table, race  # noqa: E402
from agent_tokens import TokenContender  # noqa: E402

from rlplat.contracts.rollout import SamplingParams  # noqa: E402

PROMPTS = 256
TARGET = 0.8


def wide_model(directory: str, hidden: int, layers: int) -> str:
    """The tool demo's model and tokenizer with random weights of a wider, deeper Qwen2 shape, saved in
    ``directory``: the same prompts and template, a decode step that costs what a small real model's does."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlplat_demo import tools as tool_demo

    source = tool_demo.model_dir()
    config = AutoConfig.from_pretrained(source)
    config.hidden_size, config.num_hidden_layers, config.intermediate_size = hidden, layers, 4 * hidden
    config.num_attention_heads = config.num_key_value_heads = hidden // 64
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, directory)
    return directory


def measure(model_dir: str, label: str, max_new_tokens: int, repetitions: int, warmup: int) -> tuple[list, float]:
    """Both sides on one model: rows of the table and the gateway's ratio."""
    import openai
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from rlplat_agents.config import AgentConfig
    from rlplat_agents.manager import AgentLoopManager, EngineClient
    from rlplat_demo import tools as tool_demo
    from rlplat_rollout_hf.rollout import HFRollout

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollout = HFRollout({"model_path": model_dir})
    parameters = sum(p.numel() for p in rollout.model.parameters())
    rows = pq.read_table(tool_demo.data_file("train")).to_pylist()[:PROMPTS]
    conversations = [[dict(message) for message in row["prompt"]] for row in rows]
    manager = AgentLoopManager([EngineClient(rollout)], tokenizer, AgentConfig(), pad_token_id=tokenizer.pad_token_id,
                               max_prompt_length=64)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    gateway = manager.gateway_for(sampling, max_new_tokens)
    tools = [tool_demo.TOOL_SCHEMA]
    prompts = [manager.renderer.prompt_ids(messages, tools=tools) for messages in conversations]
    stops = tuple(sorted(set(gateway.stop_token_ids)))
    direct_sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=stops)

    async def direct() -> int:
        outputs = await asyncio.gather(*(rollout.generate_tokens(prompt, direct_sampling) for prompt in prompts))
        return sum(len(output.token_ids) for output in outputs)

    def recorded(sessions) -> int:
        closed = [gateway.close(session.id) for session in sessions]
        return sum(sum(segment.builder.response_mask) for session in closed for segment in session.segments)

    async def openai_client() -> int:
        sessions = [gateway.open(manager.replicas.sticky(), sampling) for _ in conversations]
        client = openai.AsyncOpenAI(base_url=gateway.base_url(), api_key="bench", max_retries=0, timeout=600)
        async with client:
            await asyncio.gather(*(
                client.chat.completions.create(model="policy", messages=messages, tools=tools,
                                               extra_headers={"X-Session-Id": session.id})
                for session, messages in zip(sessions, conversations)))
        return recorded(sessions)

    async def aiohttp_client() -> int:
        import aiohttp

        sessions = [gateway.open(manager.replicas.sticky(), sampling) for _ in conversations]
        url = gateway.base_url() + "/chat/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def one(session, messages):
                async with http.post(url, json={"model": "policy", "messages": messages, "tools": tools},
                                     headers={"X-Session-Id": session.id}) as response:
                    return await response.json()

            await asyncio.gather(*(one(session, messages) for session, messages in zip(sessions, conversations)))
        return recorded(sessions)

    generate_tokens = TokenContender(f"generate_tokens ({PROMPTS} concurrent)", lambda: asyncio.run(direct()))
    with_openai = TokenContender(f"gateway, openai client ({PROMPTS} sessions)", lambda: asyncio.run(openai_client()))
    with_aiohttp = TokenContender(f"gateway, aiohttp client ({PROMPTS} sessions)", lambda: asyncio.run(aiohttp_client()))
    contenders = [generate_tokens, with_openai, with_aiohttp]
    try:
        race(contenders, repetitions, warmup, budget_s=0.0)
    finally:
        manager.close()
    reference = statistics.median(generate_tokens.rates())
    rows_out = []
    for contender in contenders:
        rate = statistics.median(contender.rates())
        timed = contender.tokens[len(contender.tokens) - len(contender.seconds):]
        rows_out.append([f"{label} ({parameters / 1e6:.1f}M)", contender.name, f"{contender.median_ms:.1f}",
                         f"{statistics.median(timed):.0f}", f"{rate:,.0f}", f"{rate / reference:.2f}x"])
    return rows_out, statistics.median(with_openai.rates()) / reference


def main() -> None:
    import tempfile

    import openai
    import transformers

    from rlplat_agents.config import AgentConfig

    from rlplat_demo import tools as tool_demo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="torch's threads on both sides (default: the cores less one, which the HTTP server and "
                             "clients use; a spinning OpenMP team on every core starves them)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    rows, ratios = [], {}
    with tempfile.TemporaryDirectory() as directory:
        models = [("tool demo model", str(tool_demo.model_dir())),
                  (f"Qwen2 {args.hidden_size}x{args.layers}, random", wide_model(directory, args.hidden_size, args.layers))]
        for label, model_dir in models:
            table, ratio = measure(model_dir, label, args.max_new_tokens, args.repetitions, args.warmup)
            rows += table
            ratios[label] = ratio
    print_table(
        f"hf rollout, {PROMPTS} tool-demo prompts x 1 sample, temperature 1, up to {args.max_new_tokens} new tokens "
        f"(median of {args.repetitions} interleaved repetitions)",
        ["model", "contender", "ms", "tokens", "tokens/s", "vs generate_tokens"], rows,
        notes=[describe_environment({"transformers": transformers.__version__, "openai": openai.__version__}),
               f"agent.gateway.batch_window_ms={AgentConfig().gateway.batch_window_ms:g}"],
    )
    for label, ratio in ratios.items():
        print(f"\n{label}: gateway (openai client) / generate_tokens tokens/s: {ratio:.2f}x "
              f"(target >= {TARGET}x: {'met' if ratio >= TARGET else 'NOT met'})", end="")
    print()


if __name__ == "__main__":
    main()
