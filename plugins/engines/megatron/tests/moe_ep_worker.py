"""One of two ranks of megatron-core's MoE GPT model on CPU/gloo, inside rlplat's CPU substitutes (the
allgather token dispatcher, experts as local MLPs): first with every expert on each rank (EP=1), then with the
experts split over the two ranks (EP=2), the second model loading the first's weights (its half of the
experts); both forward and backward one fixed batch. Writes both runs' logits and router gradients to
``<out>/rank<r>.pt``.

Run: ``python moe_ep_worker.py OUT_DIR`` with RANK, WORLD_SIZE=2, MASTER_ADDR and MASTER_PORT set."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

EXPERTS, TOP_K, VOCAB, LENGTH = 4, 2, 64, 16


def run(expert_parallel: int, tracker, full_state: dict | None) -> tuple[dict, dict]:
    """(the model's state, its logits and router gradients) with ``expert_parallel`` ranks per expert group."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=expert_parallel)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    tracker.seed(1234, 0, ep_rank)
    torch.manual_seed(1234)  # use_cpu_initialization draws from the default generator: the same weights on every rank
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, moe_ffn_hidden_size=64,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, expert_model_parallel_size=expert_parallel,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True, hidden_dropout=0.0,
        attention_dropout=0.0, sequence_parallel=False)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=LENGTH * 4,
                     position_embedding_type="rope")
    if full_state is not None:
        local, state = EXPERTS // expert_parallel, {}
        for name in model.state_dict():
            if ".local_experts." in name:  # local expert i of this rank is global expert ep_rank * local + i
                prefix, rest = name.split(".local_experts.", 1)
                index, tail = rest.split(".", 1)
                state[name] = full_state[f"{prefix}.local_experts.{ep_rank * local + int(index)}.{tail}"]
            else:
                state[name] = full_state[name]
        model.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    logits = model(ids, torch.arange(LENGTH)[None].expand(2, LENGTH), attention_mask=None)
    logits.float().logsumexp(-1).mean().backward()
    routers = {name: parameter.grad.clone() for name, parameter in model.named_parameters() if "router" in name}
    state = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in model.state_dict().items()}
    parallel_state.destroy_model_parallel()
    return state, {"logits": logits.detach(), "router_grads": routers}


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from rlplat_engine_megatron.cpu import CpuRNGStatesTracker, cpu_substitutes

    tracker = CpuRNGStatesTracker()
    with cpu_substitutes(tracker):
        full_state, one = run(1, tracker, None)
        _, two = run(world, tracker, full_state)
    os.makedirs(out, exist_ok=True)
    torch.save({"ep1": one, "ep2": two}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
