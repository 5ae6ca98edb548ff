"""``sgl_kernel.mamba``'s CPU functions, imported by SGLang's linear-attention (Mamba, gated delta-rule) backends:
not available here (see the package docstring); the tiny and Qwen2-family models rlplat trains never load them."""

from sgl_kernel import unavailable

causal_conv1d_fn_cpu = unavailable("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = unavailable("mamba.causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = unavailable("mamba.chunk_gated_delta_rule_cpu")
