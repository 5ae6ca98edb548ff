"""rlplat rollout engine ``hf``: generation with a transformers causal LM and its KV cache."""
