"""rlplat rollout engine ``sglang``: generation with SGLang, in-process (hybrid) or through its HTTP server."""
