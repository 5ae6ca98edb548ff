"""Put on PYTHONPATH by `make test-vllm-cpu-avx2`: every Python process of the run (the tests, vLLM's server)
answers that the CPU has no AVX-512, so vLLM's CPU platform loads its AVX2 kernels (``vllm._C_AVX2``)
instead of the AVX-512 ones, as on a CPU without AVX-512. torch's own kernels are limited to AVX2 by
``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` in the same target."""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
