"""Conformance suite for rollout engines (kind ``rollout``)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat.protocol import DataProto
from rlplat.testing.api_levels import implementation_api, skip_unless_asked

OUTPUT_KEYS = ("prompts", "responses", "response_mask", "rollout_log_probs", "input_ids", "attention_mask", "position_ids")


def left_padded_prompts(token_lists: list[list[int]], pad_token_id: int, uids: list[str] | None = None) -> DataProto:
    """A prompt batch as the data loader makes it: left padding, positions counting real tokens."""
    from rlplat.kits.data import left_padded

    uids = uids or [f"prompt-{row}" for row in range(len(token_lists))]
    return DataProto.from_dict(left_padded(token_lists, pad_token_id), {"uid": uids})


#: How far a rollout's log-probs may move when the same weights are put in other memory (a wake-up, a bind).
LOG_PROB_TOLERANCE = 1e-5


def assert_same_samples(before: DataProto, after: DataProto) -> None:
    """The same tokens, and log-probs within :data:`LOG_PROB_TOLERANCE`. Not bit for bit: a wake-up or a
    bind puts the weights in new allocations, and a CPU matmul of few rows sums in an order that depends on
    their alignment (the hf rollout reads its weights 8-byte aligned from safetensors, then holds them
    64-byte aligned: one row differs by 2.4e-7 after a sleep). Stale or missing weights move the log-probs
    by far more (8e-3 for one zeroed weight matrix of the tiny model)."""
    assert torch.equal(before.batch["responses"], after.batch["responses"])
    torch.testing.assert_close(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"], atol=LOG_PROB_TOLERANCE, rtol=0)


def reproducible(rollout, sampling: SamplingParams) -> SamplingParams:
    """``sampling`` where the rollout honours seeds, else its greedy form (the one way such a rollout
    samples the same tokens twice)."""
    if getattr(rollout, "honours_seeds", True):
        return sampling
    return dataclasses.replace(sampling, greedy=True)


class RolloutEngineConformance:
    """Fixtures to provide: ``rollout`` (a ready engine with weights loaded), ``prompt_token_lists``
    (a few prompts of different lengths as token-id lists), ``pad_token_id`` and ``stop_token_id`` (a
    token that ends a response). Optional: ``eos_token_ids`` (tokens the engine stops at by itself),
    ``named_weights`` (a list of ``(name, tensor)`` covering every weight, for the update/sleep tests;
    default: none, those tests skip), ``plugin_api`` (the plugin API range it is written for; found from its
    plugin by default, see :mod:`rlplat.testing.api_levels`).

    ``log_probs_after_filters``: True when ``rollout_log_probs`` come from the distribution after top-k /
    top-p (the contract's wording, and what ``hf`` and ``vllm`` report); an engine that reports them
    before the filters (SGLang) sets it False and says so in its README.

    Seeds: a rollout whose ``honours_seeds`` is False (the contract: its samples are not reproducible from
    ``SamplingParams.seed`` here) is held to what it can do instead. The tests that compare two generations
    compare greedy ones (same tokens, log-probs within :data:`LOG_PROB_TOLERANCE`); the seed test checks that
    greedy generation repeats itself and that sampled calls differ; the tests whose outcome depends on the
    draw make more draws, so that chance cannot fail them.
    """

    log_probs_after_filters = True
    score_tolerance = LOG_PROB_TOLERANCE
    """How far ``score_tokens`` may be from the log-probs a sample was drawn with (a rollout whose scoring pass
    computes in another order, e.g. a prefill kernel against decoding steps, sets it higher and says why)."""

    @pytest.fixture
    def named_weights(self):
        return None

    @pytest.fixture
    def plugin_api(self, rollout) -> str | None:
        """The plugin API range the rollout is written for (:mod:`rlplat.testing.api_levels`)."""
        return implementation_api(rollout)

    @pytest.fixture
    def eos_token_ids(self):
        return ()

    @pytest.fixture
    def prompts(self, prompt_token_lists, pad_token_id) -> DataProto:
        return left_padded_prompts(prompt_token_lists, pad_token_id)

    def test_generate_returns_every_key_with_the_right_shapes_and_dtypes(self, rollout, prompts):
        out = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=0))
        rows, prompt_length = len(prompts) * 2, prompts.batch["input_ids"].shape[1]
        assert len(out) == rows
        for key in OUTPUT_KEYS:
            assert key in out.batch.keys(), key
        assert out.batch["responses"].shape == (rows, 5) and out.batch["responses"].dtype == torch.long
        assert out.batch["response_mask"].shape == (rows, 5)
        assert out.batch["rollout_log_probs"].shape == (rows, 5) and out.batch["rollout_log_probs"].dtype == torch.float32
        for key in ("input_ids", "attention_mask", "position_ids"):
            assert out.batch[key].shape == (rows, prompt_length + 5), key
        assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], dim=1))

    def test_samples_of_one_prompt_are_adjacent_and_carry_its_non_tensor_data(self, rollout, prompts):
        out = rollout.generate(prompts, SamplingParams(n=3, max_new_tokens=2, seed=0))
        expected = [uid for uid in prompts.non_tensor_batch["uid"] for _ in range(3)]
        assert out.non_tensor_batch["uid"].tolist() == expected
        assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))

    def test_the_response_mask_ends_at_the_first_stop_token_and_padding_follows(
        self, rollout, prompts, pad_token_id, stop_token_id, eos_token_ids
    ):
        stops = {stop_token_id, *eos_token_ids}
        n = 4 if getattr(rollout, "honours_seeds", True) else 12  # unseeded: enough draws that one stops early
        out = rollout.generate(prompts, SamplingParams(n=n, max_new_tokens=8, seed=1, stop_token_ids=(stop_token_id,)))
        lengths = []
        for responses, mask in zip(out.batch["responses"].tolist(), out.batch["response_mask"].tolist()):
            length = sum(mask)
            lengths.append(length)
            assert length >= 1 and mask == [1] * length + [0] * (len(mask) - length)
            assert not stops & set(responses[: length - 1])
            if length < len(mask):
                assert responses[length - 1] in stops
                assert responses[length:] == [pad_token_id] * (len(mask) - length)
        assert min(lengths) < 8, "no response stopped early: choose a stop_token_id the model samples"

    def test_log_probs_are_non_positive_and_zero_outside_the_mask(self, rollout, prompts):
        out = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=2))
        log_probs, mask = out.batch["rollout_log_probs"], out.batch["response_mask"]
        assert (log_probs <= 0).all() and (log_probs[mask == 0] == 0).all()

    def test_scored_tokens_if_supported_have_the_log_probs_they_were_sampled_with(self, rollout, prompts):
        """``score_tokens`` (a distillation teacher served by the rollout) of its own samples gives their
        ``rollout_log_probs`` (no top-p / top-k filter, so both are of the whole distribution), within
        :attr:`score_tolerance`, at temperature 0.7 (1 for a rollout that scores raw logits only,
        ``scores_at_any_temperature``); its top-k is sorted and bounds them."""
        if not getattr(rollout, "scores_tokens", False):
            pytest.skip(f"{type(rollout).__name__} does not score given tokens (scores_tokens is False)")
        temperature = 0.7 if getattr(rollout, "scores_at_any_temperature", True) else 1.0
        out = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, temperature=temperature, seed=3))
        scored = rollout.score_tokens(out, temperature=temperature, top_k=3).batch
        mask = out.batch["response_mask"].bool()
        torch.testing.assert_close(scored["log_probs"][mask], out.batch["rollout_log_probs"][mask],
                                   atol=self.score_tolerance, rtol=0)
        assert (scored["log_probs"][~mask] == 0).all()
        values, ids = scored["top_k_log_probs"], scored["top_k_ids"]
        assert values.shape == ids.shape == (*mask.shape, 3) and ids.dtype == torch.long
        assert (values[mask][:, :-1] >= values[mask][:, 1:]).all()
        assert (values[mask][:, 0] >= scored["log_probs"][mask] - self.score_tolerance).all()

    def test_the_same_seed_gives_the_same_samples_and_another_seed_others(self, rollout, prompts):
        if not getattr(rollout, "honours_seeds", True):
            # what such a rollout can promise: greedy generation repeats itself, sampling does not
            greedy = SamplingParams(n=2, max_new_tokens=6, greedy=True)
            first, second = rollout.generate(prompts, greedy), rollout.generate(prompts, greedy)
            assert torch.equal(first.batch["responses"], second.batch["responses"])
            torch.testing.assert_close(second.batch["rollout_log_probs"], first.batch["rollout_log_probs"], atol=LOG_PROB_TOLERANCE, rtol=0)
            sampled = [rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=7)).batch["responses"] for _ in range(2)]
            assert not torch.equal(*sampled), "two sampled calls drew the same tokens: is the rollout sampling greedily?"
            return
        first = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=7))
        second = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=7))
        third = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=8))
        assert torch.equal(first.batch["responses"], second.batch["responses"])
        assert torch.equal(first.batch["rollout_log_probs"], second.batch["rollout_log_probs"])
        assert not torch.equal(first.batch["responses"], third.batch["responses"])

    def test_copies_of_one_prompt_in_a_seeded_call_draw_samples_of_their_own(self, rollout, prompt_token_lists, pad_token_id,
                                                                              plugin_api):
        """Every row of a seeded call draws from a stream of its own: 8 copies of one prompt, 2 samples each,
        are not 8 repeats of the same 2 (a rollout that gave each prompt the call's seed returned exactly that,
        and correlated the samples of different prompts too). More than half of the copies must differ: the
        fixtures' model samples 6 tokens with variety (the seed test needs that already), so independent
        copies collide rarely."""
        skip_unless_asked(plugin_api, "1.1", "independent samples for copies of one prompt")
        copies = left_padded_prompts([prompt_token_lists[0]] * 8, pad_token_id)
        out = rollout.generate(copies, SamplingParams(n=2, max_new_tokens=6, seed=19))
        rows = [tuple(row) for row in out.batch["responses"].tolist()]
        distinct_copies = {tuple(rows[2 * copy : 2 * copy + 2]) for copy in range(8)}
        assert len(distinct_copies) > 4, f"{len(distinct_copies)} distinct sample pairs over 8 copies of one prompt"

    def test_greedy_samples_are_identical(self, rollout, prompts):
        out = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=4, greedy=True))
        assert torch.equal(out.batch["responses"][0::2], out.batch["responses"][1::2])

    def test_top_k_one_is_greedy(self, rollout, prompts):
        greedy = rollout.generate(prompts, SamplingParams(max_new_tokens=4, greedy=True))
        top_one = rollout.generate(prompts, SamplingParams(max_new_tokens=4, top_k=1, seed=3))
        assert torch.equal(greedy.batch["responses"], top_one.batch["responses"])
        mask = top_one.batch["response_mask"] == 1
        if self.log_probs_after_filters:
            assert (top_one.batch["rollout_log_probs"][mask] == 0).all()  # probability 1 after the filter
        else:  # before the filter, top-k 1 reports what greedy reports: the unfiltered softmax
            assert torch.allclose(greedy.batch["rollout_log_probs"], top_one.batch["rollout_log_probs"])

    def test_generate_tokens_matches_generate_for_one_prompt(self, rollout, prompt_token_lists, pad_token_id):
        sampling = reproducible(rollout, SamplingParams(max_new_tokens=5, seed=11))
        tokens = asyncio.run(rollout.generate_tokens(prompt_token_lists[0], sampling))
        batch = rollout.generate(left_padded_prompts(prompt_token_lists[:1], pad_token_id), sampling)
        length = int(batch.batch["response_mask"][0].sum())
        assert tokens.token_ids == batch.batch["responses"][0, :length].tolist()
        assert tokens.log_probs == pytest.approx(batch.batch["rollout_log_probs"][0, :length].tolist(), abs=1e-5)
        assert tokens.finish_reason in ("stop", "length")

    def test_concurrent_generate_tokens_calls_each_honour_their_own_stop_tokens_and_lengths(
        self, rollout, prompt_token_lists, stop_token_id, eos_token_ids, plugin_api
    ):
        skip_unless_asked(plugin_api, "1.1", "concurrent generate_tokens calls")
        # 12 calls at once: even ones stop at stop_token_id (or EOS) within 8 tokens, odd ones only at
        # EOS within 1..5 tokens; each must end by its own rule, whatever the others in flight
        requests = []
        for index in range(12 if getattr(rollout, "honours_seeds", True) else 36):  # unseeded: enough that one stops at its token
            prompt = prompt_token_lists[index % len(prompt_token_lists)]
            if index % 2 == 0:
                requests.append((prompt, SamplingParams(max_new_tokens=8, stop_token_ids=(stop_token_id,), seed=index)))
            else:
                requests.append((prompt, SamplingParams(max_new_tokens=1 + index // 2 % 5, seed=index)))

        async def all_at_once():
            return await asyncio.gather(*(rollout.generate_tokens(prompt, sampling) for prompt, sampling in requests))

        outputs = asyncio.run(all_at_once())
        assert len(outputs) == len(requests)
        for (_, sampling), output in zip(requests, outputs):
            stops = set(eos_token_ids) | set(sampling.stop_token_ids)
            length = len(output.token_ids)
            assert 1 <= length <= sampling.max_new_tokens and len(output.log_probs) == length
            assert all(log_prob <= 0 for log_prob in output.log_probs)
            assert not stops & set(output.token_ids[:-1])
            if output.finish_reason == "stop":
                assert output.token_ids[-1] in stops
            else:
                assert output.finish_reason == "length" and length == sampling.max_new_tokens
        stopped_by_own_token = [output.token_ids[-1] == stop_token_id for (_, sampling), output in zip(requests, outputs)
                                if sampling.stop_token_ids]
        assert any(stopped_by_own_token), "no call stopped at stop_token_id: choose a stop_token_id the model samples"

    def test_generate_tokens_refuses_more_than_one_sample(self, rollout, prompt_token_lists, plugin_api):
        skip_unless_asked(plugin_api, "1.1", "refusing n > 1 in generate_tokens")
        with pytest.raises(ValueError, match="n=2"):
            asyncio.run(rollout.generate_tokens(prompt_token_lists[0], SamplingParams(n=2)))

    def test_missing_prompt_keys_are_named(self, rollout, prompts):
        with pytest.raises(KeyError, match="position_ids"):
            rollout.generate(prompts.select(batch_keys=["input_ids", "attention_mask"]), SamplingParams())

    def test_updating_with_its_own_weights_changes_nothing(self, rollout, prompts, named_weights):
        if named_weights is None:
            pytest.skip("no named_weights fixture")
        sampling = reproducible(rollout, SamplingParams(n=2, max_new_tokens=5, seed=5))
        before = rollout.generate(prompts, sampling)
        rollout.update_weights(named_weights)
        after = rollout.generate(prompts, sampling)
        assert torch.equal(before.batch["responses"], after.batch["responses"])

    def test_sleep_then_wake_and_update_reproduces_the_samples(self, rollout, prompts, named_weights):
        if named_weights is None:
            pytest.skip("no named_weights fixture")
        sampling = reproducible(rollout, SamplingParams(n=2, max_new_tokens=5, seed=9))
        before = rollout.generate(prompts, sampling)
        rollout.sleep()
        with pytest.raises(RuntimeError, match="asleep"):
            rollout.generate(prompts, sampling)
        rollout.wake_up()
        rollout.update_weights(named_weights)
        assert_same_samples(before, rollout.generate(prompts, sampling))

    def test_bound_weights_if_supported_are_read_in_place(self, rollout, prompts, named_weights):
        if named_weights is None:
            pytest.skip("no named_weights fixture")
        sampling = reproducible(rollout, SamplingParams(n=2, max_new_tokens=5, seed=17))
        before = rollout.generate(prompts, sampling)
        owned = [(name, tensor.detach().clone()) for name, tensor in named_weights]
        if not rollout.bind_weights(owned):
            pytest.skip("this rollout does not bind weights (bind_weights returned False)")
        assert_same_samples(before, rollout.generate(prompts, sampling))
        with torch.no_grad():  # a change to the bound tensors (an optimizer step) is what the next call samples from
            for _, tensor in owned:
                tensor.mul_(0.0)
        changed = rollout.generate(prompts, sampling)
        assert not torch.equal(changed.batch["rollout_log_probs"], before.batch["rollout_log_probs"])
        kept = [tensor.clone() for _, tensor in owned]
        rollout.update_weights(named_weights)  # a copying update never writes into bound tensors
        assert all(torch.equal(tensor, copy) for (_, tensor), copy in zip(owned, kept))
        assert_same_samples(before, rollout.generate(prompts, sampling))

    def test_weight_fingerprints_if_offered_show_what_update_weights_loaded(self, rollout, named_weights):
        from rlplat.kits.weights import compare, fingerprint

        if named_weights is None:
            pytest.skip("no named_weights fixture")
        if rollout.weight_fingerprints() is None:
            pytest.skip("this rollout offers no weight fingerprints (weight_fingerprints returned None)")
        middle = len(named_weights) // 2  # a decoder layer's weight: never one of a tied pair (embeddings, output layer)
        changed = [(name, tensor * 1.5 if index == middle else tensor) for index, (name, tensor) in enumerate(named_weights)]
        try:
            rollout.update_weights(changed)
            compared, problems = compare({name: fingerprint(tensor) for name, tensor in changed}, rollout.weight_fingerprints())
            assert compared == len({name for name, _ in changed}) and problems == {}, problems
            compared, problems = compare({name: fingerprint(tensor) for name, tensor in named_weights}, rollout.weight_fingerprints())
            assert list(problems) == [named_weights[middle][0]]  # the one tensor that differs, and only it
        finally:
            rollout.update_weights(named_weights)

    def test_generations_in_flight_if_supported_take_new_weights_and_record_their_versions(
            self, rollout, prompt_token_lists, named_weights):
        """For each of ``partial_rollout_modes``: a ``generate_tokens`` call paused, given new weights numbered
        v + 1 and resumed finishes, its tokens numbered v then v + 1 (``TokenOutput.versions``)."""
        import threading

        modes = tuple(type(rollout).partial_rollout_modes)
        if not modes:
            pytest.skip("this rollout cannot carry generations in flight over new weights (partial_rollout_modes)")
        if named_weights is None:
            pytest.skip("no named_weights fixture")
        changed = [(name, tensor * 1.01) for name, tensor in named_weights]
        try:
            for number, mode in enumerate(modes):
                version = 10 * (number + 1)
                rollout.set_weights_version(version, mode)
                outcome: dict = {}

                def generate() -> None:
                    sampling = SamplingParams(temperature=1.0, seed=3, max_new_tokens=64)
                    outcome["output"] = asyncio.run(rollout.generate_tokens(prompt_token_lists[0], sampling))

                thread = threading.Thread(target=generate)
                thread.start()
                rollout.pause_generation()
                try:
                    rollout.update_weights(changed)
                    rollout.set_weights_version(version + 1, mode)
                finally:
                    rollout.resume_generation()
                thread.join(timeout=120)
                output = outcome["output"]
                assert output.versions is not None and len(output.versions) == len(output.token_ids), mode
                assert output.versions == sorted(output.versions) and set(output.versions) <= {version, version + 1}, mode
        finally:
            rollout.update_weights(named_weights)
            rollout.set_weights_version(0, modes[0])

    def test_abort_if_supported_returns_a_paused_generation_cut_short_and_then_serves_as_usual(self, rollout, prompt_token_lists):
        """A rollout with ``partial_rollout_modes``: a ``generate_tokens`` call paused, then aborted, returns its
        tokens so far with ``finish_reason="abort"``; the next call is served to its end."""
        import threading

        if not tuple(type(rollout).partial_rollout_modes):
            pytest.skip("this rollout cannot carry generations in flight over new weights (partial_rollout_modes)")
        sampling = SamplingParams(temperature=1.0, seed=5, max_new_tokens=64, stop_token_ids=())
        outcome: dict = {}
        thread = threading.Thread(target=lambda: outcome.update(
            output=asyncio.run(rollout.generate_tokens(prompt_token_lists[0], sampling))))
        rollout.pause_generation()
        try:
            thread.start()
            thread.join(timeout=1.0)  # the request reaches the rollout and waits there
            rollout.abort_generation()
        finally:
            rollout.resume_generation()
        thread.join(timeout=120)
        output = outcome["output"]
        assert output.finish_reason == "abort" and len(output.token_ids) < 64
        assert len(output.log_probs) == len(output.token_ids)
        assert output.versions is None or len(output.versions) == len(output.token_ids)
        after = asyncio.run(rollout.generate_tokens(prompt_token_lists[0], SamplingParams(seed=5, max_new_tokens=3)))
        assert after.finish_reason in ("stop", "length") and 1 <= len(after.token_ids) <= 3

    def test_a_staged_wake_up_weights_then_kv_cache_reproduces_the_samples(self, rollout, prompts, named_weights):
        if named_weights is None:
            pytest.skip("no named_weights fixture")
        sampling = reproducible(rollout, SamplingParams(n=2, max_new_tokens=5, seed=13))
        before = rollout.generate(prompts, sampling)
        rollout.sleep()
        rollout.wake_up_weights()
        rollout.update_weights(named_weights)
        rollout.wake_up_kv_cache()
        assert_same_samples(before, rollout.generate(prompts, sampling))


def trainer_weights(model) -> list[tuple[str, torch.Tensor]]:
    """A transformers model's weights as a training engine sends them (copies; a tied output layer once, under
    the embedding's name)."""
    return [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items() if name != "lm_head.weight"]


def transformers_log_probs(model, out: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """``[B, R]`` log-probs of the responses of a rollout's output ``out`` under the transformers ``model`` (one
    float32 forward of the padded rows, ``log softmax(logits / temperature)``), 0 where masked."""
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits.float()
    prompt_length = out.batch["prompts"].shape[1]
    expected = torch.log_softmax(logits[:, prompt_length - 1 : -1] / temperature, -1)
    return expected.gather(-1, out.batch["responses"][..., None]).squeeze(-1) * out.batch["response_mask"]


def concurrent_calls_difference(rollout, model, prompts: list[list[int]], calls: int = 6, seeded: bool = True) -> float:
    """``calls`` concurrent ``generate_tokens`` calls (4 new tokens, over ``prompts`` in turn; seeded with their
    index when ``seeded``): the largest difference between a call's log-probs and the transformers ``model``'s
    of the same tokens."""
    async def all_at_once():
        return await asyncio.gather(*(rollout.generate_tokens(prompts[index % len(prompts)], SamplingParams(
            max_new_tokens=4, seed=index if seeded else None)) for index in range(calls)))

    largest = 0.0
    for index, output in enumerate(asyncio.run(all_at_once())):
        prompt = prompts[index % len(prompts)]
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([prompt + output.token_ids])).logits[0, len(prompt) - 1 : -1].float(), -1)
        expected = log_probs.gather(-1, torch.tensor(output.token_ids)[:, None]).squeeze(-1)
        largest = max(largest, float((expected - torch.tensor(output.log_probs)).abs().max()))
    return largest


def log_probs_after_syncs(rollout, trainer, prompts: DataProto, sampling: SamplingParams, loss_fn, steps: int = 3,
                          bucket_bytes: int = 100_000) -> list[float]:
    """For each of ``steps`` steps: ``rollout`` samples ``prompts``, ``trainer`` (a training engine on the same
    model, its ``init_model`` done) takes one step of ``loss_fn`` on the samples and syncs its weights into the
    rollout in buckets of ``bucket_bytes`` (as the trainer does), and the rollout samples again: the largest
    difference per token between the rollout's log-probs of those samples and the engine's forward of them. The
    rollout keeps the last weights."""
    differences = []
    for _ in range(steps):
        out = rollout.generate(prompts, sampling)
        batch = out.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses", "response_mask"])
        batch.meta_info.update(temperature=sampling.temperature, global_token_count=int(out.batch["response_mask"].sum()))
        trainer.train_batch(batch, loss_fn)
        for bucket in trainer.named_weights(bucket_bytes=bucket_bytes):
            rollout.update_weights(bucket)
        synced = rollout.generate(prompts, sampling)
        expected = trainer.forward(synced.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses"]))
        mask = synced.batch["response_mask"]
        differences.append(float(((expected.batch["log_probs"] - synced.batch["rollout_log_probs"]) * mask).abs().max()))
    return differences


TINY_MODEL_PROMPTS = [[1, 5, 6, 14, 7, 8, 15], [1, 9, 14, 10, 15], [1, 4, 15]]


class TinyModelRolloutFixtures:
    """The conformance suite's fixtures for the tiny Qwen2 of :mod:`rlplat.testing.tiny_models` made with
    seed 0 (``save_tiny_model(directory, seed=0)``) and its arithmetic tokenizer: three prompts of
    different lengths, pad 0, EOS 2, ``=`` (15) as a stop token the random model samples often, and the
    model's weights by name. Mix in before :class:`RolloutEngineConformance`; provide ``rollout``."""

    @pytest.fixture
    def prompt_token_lists(self):
        return TINY_MODEL_PROMPTS

    @pytest.fixture
    def pad_token_id(self):
        return 0

    @pytest.fixture
    def stop_token_id(self):
        return 15

    @pytest.fixture
    def eos_token_ids(self):
        return (2,)

    @pytest.fixture
    def named_weights(self):
        from rlplat.testing.tiny_models import tiny_causal_lm

        return list(tiny_causal_lm(seed=0).state_dict().items())
