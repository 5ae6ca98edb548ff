"""The tiny model and batches the megatron engine's tests share (imported by conftest, the tests and
numerics_worker.py, which runs outside pytest)."""

from __future__ import annotations

import torch

from rlplat import DataProto

#: The tiny model of DEMO_NOTES.md: vocab 16, hidden 128, intermediate 512, 2 layers, 4 heads, tied embeddings.
TINY_QWEN2 = dict(
    model_type="qwen2",
    vocab_size=16,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)

PROMPT_LENGTH, RESPONSE_LENGTH = 6, 5


def make_batch(rows: int = 8, seed: int = 0) -> DataProto:
    """``rows`` sequences of 6 prompt + 5 response tokens: row ``r`` has ``r % 3`` left-padding tokens in
    its prompt and ends ``r % 4`` tokens early (right padding). Carries ``advantages`` and ``returns``."""
    generator = torch.Generator().manual_seed(seed)
    length = PROMPT_LENGTH + RESPONSE_LENGTH
    input_ids = torch.randint(4, 16, (rows, length), generator=generator)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    for row in range(rows):
        attention_mask[row, : row % 3] = 0
        attention_mask[row, length - row % 4 :] = 0
    input_ids = input_ids * attention_mask
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, PROMPT_LENGTH:],
            "response_mask": attention_mask[:, PROMPT_LENGTH:].float(),
            "advantages": torch.randn(rows, RESPONSE_LENGTH, generator=generator),
            "returns": torch.randn(rows, RESPONSE_LENGTH, generator=generator),
            "values": torch.zeros(rows, RESPONSE_LENGTH),
        }
    )
