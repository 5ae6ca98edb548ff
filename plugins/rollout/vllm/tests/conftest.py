"""Without a GPU, vLLM cannot infer its platform and refuses to build its config classes; the API
compatibility tests only parse arguments and build configs, so they run under vLLM's CPU platform."""

import importlib.util
import os

import torch

if importlib.util.find_spec("vllm") is not None and not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
