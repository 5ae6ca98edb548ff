"""rlplat rollout engine ``vllm``: generation with vLLM, in-process (hybrid) or through its HTTP server."""
