"""Concurrent ``generate_tokens`` calls of the hf rollout share forward passes: what a request gets does
not depend on what it was batched with (greedy: the same tokens as ``generate``; seeded: the same draws
as alone, in any admission order, on any engine with the same weights), rows join and leave a running
batch, and errors reach every waiting caller."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import threading

import pytest
import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat.testing import left_padded_prompts
from rlplat_rollout_hf.batching import RunningBatch, TokenRequest
from rlplat_rollout_hf.rollout import HFRollout
from rlplat_rollout_hf.sampling import filtered_logits

# lengths 7, 5, 3, 9, 1, 4: the batch's left padding differs from each row's own
PROMPTS = [[1, 5, 6, 14, 7, 8, 15], [1, 9, 14, 10, 15], [1, 4, 15], [1, 5, 6, 7, 14, 8, 9, 4, 15], [1], [1, 13, 12, 15]]


def concurrently(engine, requests):
    """``generate_tokens`` for every ``(prompt, sampling)`` at once, in one event loop."""

    async def gathered():
        return await asyncio.gather(*(engine.generate_tokens(prompt, sampling) for prompt, sampling in requests))

    return asyncio.run(gathered())


def alone(engine, prompt, sampling):
    """The sample ``generate`` draws for ``prompt`` in a batch of one: (tokens, log-probs)."""
    out = engine.generate(left_padded_prompts([prompt], 0), sampling)
    length = int(out.batch["response_mask"][0].sum())
    return out.batch["responses"][0, :length].tolist(), out.batch["rollout_log_probs"][0, :length].tolist()


def test_concurrent_greedy_requests_equal_generate_on_prompts_of_different_lengths(engine):
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    outputs = concurrently(engine, [(prompt, greedy) for prompt in PROMPTS])
    batched = engine.generate(left_padded_prompts(PROMPTS, 0), greedy)
    for row, (prompt, output) in enumerate(zip(PROMPTS, outputs)):
        length = int(batched.batch["response_mask"][row].sum())
        assert output.token_ids == batched.batch["responses"][row, :length].tolist()
        assert output.log_probs == pytest.approx(batched.batch["rollout_log_probs"][row, :length].tolist(), abs=1e-5)
        tokens, log_probs = alone(engine, prompt, greedy)
        assert output.token_ids == tokens and output.log_probs == pytest.approx(log_probs, abs=1e-5)


def test_positions_start_at_each_prompts_first_token_in_a_model_with_absolute_positions():
    # rotary models are blind to a shift of all positions; GPT-2's learned position embeddings are not
    torch.manual_seed(0)
    engine = HFRollout({"model_config": {"model_type": "gpt2", "vocab_size": 16, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                         "n_positions": 64, "initializer_range": 0.5, "eos_token_id": 2, "pad_token_id": 0}})
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    for prompt, output in zip(PROMPTS, concurrently(engine, [(prompt, greedy) for prompt in PROMPTS])):
        tokens, log_probs = alone(engine, prompt, greedy)
        assert output.token_ids == tokens and output.log_probs == pytest.approx(log_probs, abs=1e-5)


def test_a_seeded_request_draws_the_same_tokens_alone_and_among_others(engine):
    seeded = SamplingParams(max_new_tokens=10, temperature=0.9, seed=123)
    by_itself = concurrently(engine, [(PROMPTS[0], seeded)])[0]
    others = [(prompt, SamplingParams(max_new_tokens=3 + row, temperature=0.9, seed=None if row % 2 else row))
              for row, prompt in enumerate(PROMPTS)]
    among_others = concurrently(engine, others[:3] + [(PROMPTS[0], seeded)] + others[3:])[3]
    assert among_others.token_ids == by_itself.token_ids
    assert among_others.log_probs == pytest.approx(by_itself.log_probs, abs=1e-5)
    tokens, log_probs = alone(engine, PROMPTS[0], seeded)
    assert by_itself.token_ids == tokens and by_itself.log_probs == pytest.approx(log_probs, abs=1e-5)


def test_seeded_requests_draw_the_same_tokens_in_any_admission_order_and_on_another_engine(model_dir):
    # what an exact resume needs: a new engine (another generator seed) with the same weights redraws them
    first, second = HFRollout({"model_path": model_dir, "seed": 1}), HFRollout({"model_path": model_dir, "seed": 2})
    requests = [(prompt, SamplingParams(max_new_tokens=8, temperature=1.2, top_p=0.95, seed=1_000 + row))
                for row, prompt in enumerate(PROMPTS)]
    in_order = concurrently(first, requests)
    reversed_on_another_engine = concurrently(second, requests[::-1])[::-1]
    for output, again in zip(in_order, reversed_on_another_engine):
        assert again.token_ids == output.token_ids
        assert again.log_probs == pytest.approx(output.log_probs, abs=1e-5)
    # and the seeds matter: the same prompt with other seeds draws other responses
    same_prompt = concurrently(first, [(PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=1.2, seed=seed)) for seed in range(6)])
    assert len({tuple(output.token_ids) for output in same_prompt}) > 1


def test_requests_without_a_seed_draw_from_the_engine_generator(model_dir):
    sampling = SamplingParams(max_new_tokens=6)
    first, second = HFRollout({"model_path": model_dir, "seed": 5}), HFRollout({"model_path": model_dir, "seed": 5})
    # Exact, log-probs too: both engines read their weights from the same files (the same alignment) and
    # decode the same 4 rows through the same kernels in this process.
    assert concurrently(first, [(PROMPTS[0], sampling)] * 4) == concurrently(second, [(PROMPTS[0], sampling)] * 4)


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=6, temperature=0.7), SamplingParams(max_new_tokens=6, top_k=4, top_p=0.8)])
@pytest.mark.parametrize("seeded", [False, True])
def test_log_probs_are_those_of_the_filtered_distribution_under_a_full_forward(engine, sampling, seeded):
    outputs = concurrently(engine, [(prompt, dataclasses.replace(sampling, seed=row if seeded else None))
                                    for row, prompt in enumerate(PROMPTS)])
    for prompt, output in zip(PROMPTS, outputs):
        sequence = torch.tensor([prompt + output.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=sequence).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(filtered_logits(logits, sampling), -1).gather(-1, torch.tensor(output.token_ids)[:, None])
        assert expected.squeeze(-1).tolist() == pytest.approx(output.log_probs, abs=1e-5)


def test_more_requests_than_max_batch_rows_join_as_rows_finish(model_dir):
    engine = HFRollout({"model_path": model_dir, "max_batch_rows": 2})
    requests = [(prompt, SamplingParams(max_new_tokens=2 + row, greedy=True)) for row, prompt in enumerate(PROMPTS)]
    outputs = concurrently(engine, requests)
    for (prompt, sampling), output in zip(requests, outputs):
        assert output.token_ids == alone(engine, prompt, sampling)[0]


def test_greedy_and_sampled_requests_in_flight_together_each_get_their_own_setting(engine):
    greedy, sampled = SamplingParams(max_new_tokens=5, greedy=True), SamplingParams(max_new_tokens=5, seed=3)
    outputs = concurrently(engine, [(prompt, greedy if row % 2 else sampled) for row, prompt in enumerate(PROMPTS)])
    for row, (prompt, output) in enumerate(zip(PROMPTS, outputs)):
        assert output.token_ids == alone(engine, prompt, greedy if row % 2 else sampled)[0]


def test_requests_with_other_settings_first_in_line_stop_new_rows_joining_until_the_batch_drains(model_dir):
    engine = HFRollout({"model_path": model_dir, "max_batch_rows": 3})
    greedy, sampled = SamplingParams(greedy=True), SamplingParams(temperature=0.5)
    requests = [TokenRequest([1], sampling, frozenset()) for sampling in (greedy, sampled, greedy, greedy, greedy)]
    running = RunningBatch(engine.model, engine.device, 0, ("greedy",))
    running.rows = [requests[0]]
    engine.batcher.pending.extend(requests[1:])
    assert engine.batcher.take(running) == []  # the sampled request waits longest: greedy ones may not overtake it
    assert engine.batcher.take(None) == [requests[1]]  # a new batch for it, alone: the next one is greedy
    assert engine.batcher.take(None) == requests[2:5]  # then the greedy ones, max_batch_rows = 3 at most
    running.rows = requests[2:4]
    engine.batcher.pending.extend([requests[0]] * 2)
    assert engine.batcher.take(running) == [requests[0]]  # room for one more row


class TestRunningBatch:
    """Rows joining a batch that is decoding: the cache of the longer side is left padded for the
    other, finished rows leave and padding columns nobody needs are trimmed."""

    def decode(self, engine, first, later, steps_before_joining):
        """``first`` and ``later`` map prompts to their sampling; returns each prompt's request and,
        after every step, (cache width, the most tokens a row has cached)."""
        key = ("greedy",) if next(iter(first.values())).greedy else ("sample",)
        batch = RunningBatch(engine.model, engine.device, 0, key)
        requests = {prompt: self.request(engine, list(prompt), sampling) for prompt, sampling in {**first, **later}.items()}
        batch.admit([requests[prompt] for prompt in first])
        for _ in range(steps_before_joining):
            batch.step(engine.generator)
        batch.admit([requests[prompt] for prompt in later])
        widths = []
        while batch.rows:
            batch.step(engine.generator)
            if batch.rows:
                widths.append((batch.attention_mask.shape[1], max(row.cached_length() for row in batch.rows)))
        return requests, widths

    @staticmethod
    def request(engine, prompt, sampling):
        return TokenRequest(prompt, sampling, frozenset(engine.eos_token_ids))

    def test_rows_joining_after_some_steps_decode_as_they_would_alone(self, engine):
        # the first row has 5 + 3 cached tokens when the others join: a 9-token prompt widens the cache
        # on the left (and leaves after 2 tokens, so the cache narrows again), a 1-token prompt is
        # padded on the left
        greedy, short = SamplingParams(max_new_tokens=12, greedy=True), SamplingParams(max_new_tokens=2, greedy=True)
        first = {tuple(PROMPTS[1]): greedy}
        later = {tuple(PROMPTS[3]): short, tuple(PROMPTS[4]): greedy, tuple(PROMPTS[2]): greedy}
        requests, widths = self.decode(engine, first, later, steps_before_joining=3)
        for prompt, request in requests.items():
            tokens, log_probs = alone(engine, list(prompt), request.sampling)
            assert request.token_ids == tokens
            assert request.log_probs == pytest.approx(log_probs, abs=1e-5)
        # the cache is as wide as the longest row needs (+1: the token fed at this step); right after the
        # join that is the 9-token prompt, then the first row (5 prompt + 4 sampled tokens cached when the short row left)
        assert widths[:2] == [(10, 9), (10, 9)]
        assert all(width == most + 1 for width, most in widths)

    def test_seeded_rows_joining_later_draw_as_they_would_alone(self, engine):
        sampling = SamplingParams(max_new_tokens=8, seed=42)
        first = {tuple(PROMPTS[0]): sampling, tuple(PROMPTS[2]): sampling}
        later = {tuple(PROMPTS[3]): sampling, tuple(PROMPTS[4]): SamplingParams(max_new_tokens=8, seed=7)}
        requests, _ = self.decode(engine, first, later, steps_before_joining=2)
        for prompt, request in requests.items():
            assert request.token_ids == alone(engine, list(prompt), request.sampling)[0]


def test_a_failing_decoding_step_reaches_every_waiting_caller_and_the_engine_recovers(engine):
    real_forward, calls = engine.model.forward, []

    def forward_failing_at_the_first_decoding_step(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real_forward(*args, **kwargs)

    engine.model.forward = forward_failing_at_the_first_decoding_step
    sampling = SamplingParams(max_new_tokens=5, stop_token_ids=(), greedy=True)

    async def gathered():
        return await asyncio.gather(*(engine.generate_tokens(prompt, sampling) for prompt in PROMPTS), return_exceptions=True)

    outcomes = asyncio.run(gathered())
    assert len(calls) == 2 and calls[0][0] == len(PROMPTS)  # one prefill of every prompt, then the failing step
    assert all(isinstance(outcome, RuntimeError) and "device lost" in str(outcome) for outcome in outcomes)
    assert concurrently(engine, [(PROMPTS[0], sampling)])[0].token_ids == alone(engine, PROMPTS[0], sampling)[0]


def test_a_failing_prefill_fails_only_the_requests_it_admits(engine):
    sampling = SamplingParams(max_new_tokens=6, greedy=True)
    real_forward = engine.model.forward
    first_decoding, second_queued = threading.Event(), threading.Event()

    def forward_refusing_one_token_prompts(*args, **kwargs):
        input_ids, position_ids = kwargs["input_ids"], kwargs["position_ids"]
        if input_ids.shape[1] == 1 and int(position_ids.max()) == 0:
            raise RuntimeError("bad prompt")
        if input_ids.shape[1] == 1 and not first_decoding.is_set():  # hold the first decoding step until the second request waits
            first_decoding.set()
            second_queued.wait(timeout=60)
        return real_forward(*args, **kwargs)

    engine.model.forward = forward_refusing_one_token_prompts

    async def second_arrives_while_the_first_decodes():
        first = asyncio.ensure_future(engine.generate_tokens(PROMPTS[3], sampling))
        await asyncio.to_thread(first_decoding.wait, 60)
        second = asyncio.ensure_future(engine.generate_tokens(PROMPTS[4], sampling))
        await asyncio.sleep(0)  # the second task runs up to its wait: its request is queued
        second_queued.set()
        return await asyncio.gather(first, second, return_exceptions=True)

    first, second = asyncio.run(second_arrives_while_the_first_decodes())
    assert isinstance(second, RuntimeError) and "bad prompt" in str(second)
    engine.model.forward = real_forward
    assert first.token_ids == alone(engine, PROMPTS[3], sampling)[0] and len(first.token_ids) > 1


def test_a_fault_of_the_batcher_itself_reaches_every_waiting_caller_and_the_next_calls_are_served(engine):
    real_take, greedy = engine.batcher.take, SamplingParams(max_new_tokens=3, greedy=True)

    def take_failing_once(batch):
        engine.batcher.take = real_take
        raise RuntimeError("queue broken")

    engine.batcher.take = take_failing_once

    async def gathered():
        return await asyncio.gather(*(engine.generate_tokens(prompt, greedy) for prompt in PROMPTS), return_exceptions=True)

    assert all(isinstance(outcome, RuntimeError) and "queue broken" in str(outcome) for outcome in asyncio.run(gathered()))
    assert concurrently(engine, [(PROMPTS[0], greedy)])[0].token_ids == alone(engine, PROMPTS[0], greedy)[0]


def test_queued_requests_of_a_rollout_put_to_sleep_get_the_asleep_error(engine):
    async def queued_then_sleep():
        tasks = [asyncio.ensure_future(engine.generate_tokens(prompt, SamplingParams(max_new_tokens=3))) for prompt in PROMPTS]
        await asyncio.sleep(0)  # every task has queued its request; the worker starts after this iteration
        engine.sleep()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(queued_then_sleep())
    assert all(isinstance(outcome, RuntimeError) and "asleep" in str(outcome) for outcome in outcomes)
    with pytest.raises(RuntimeError, match="asleep"):
        asyncio.run(engine.generate_tokens(PROMPTS[0], SamplingParams()))


def test_callers_in_several_threads_with_their_own_event_loops_are_served(engine):
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    results: dict[int, list] = {}
    both_running = threading.Barrier(2)

    def caller(index):
        both_running.wait()
        results[index] = concurrently(engine, [(prompt, greedy) for prompt in PROMPTS[index::2]])

    threads = [threading.Thread(target=caller, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    for index in range(2):
        for prompt, output in zip(PROMPTS[index::2], results[index]):
            assert output.token_ids == alone(engine, prompt, greedy)[0]


def test_a_cancelled_caller_does_not_disturb_the_others(engine):
    greedy = SamplingParams(max_new_tokens=6, greedy=True)

    async def one_cancelled():
        tasks = [asyncio.ensure_future(engine.generate_tokens(prompt, greedy)) for prompt in PROMPTS]
        await asyncio.sleep(0)
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(one_cancelled())
    assert isinstance(outcomes[1], asyncio.CancelledError)
    for prompt, outcome in list(zip(PROMPTS, outcomes))[2:]:
        assert outcome.token_ids == alone(engine, prompt, greedy)[0]


def test_prompt_ids_outside_the_vocabulary_are_refused_with_their_position(engine):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 16\) at \(position, id\) \[\(1, 99\)\]"):
        asyncio.run(engine.generate_tokens([1, 99], SamplingParams()))


def test_a_pickled_engine_batches_requests_too(engine):
    copy = pickle.loads(pickle.dumps(engine))
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    requests = [(prompt, greedy) for prompt in PROMPTS]
    # The same tokens; log-probs within a few float32 ulps, not bit for bit: the copy's weights are fresh
    # 64-byte aligned allocations, the engine's sit where safetensors put them (8-byte aligned), and a
    # product of few rows sums in an order that depends on that (one request alone: 1.2e-7 apart on this
    # CPU). A weight matrix missing from the copy (zeroed) moves them by 8e-3 or more, greedy tokens unchanged.
    copied_outputs, original_outputs = concurrently(copy, requests), concurrently(engine, requests)
    assert len(copied_outputs) == len(original_outputs) == len(PROMPTS)
    for copied, original in zip(copied_outputs, original_outputs):
        assert copied.token_ids == original.token_ids and copied.finish_reason == original.finish_reason
        assert copied.log_probs == pytest.approx(original.log_probs, abs=1e-5)
