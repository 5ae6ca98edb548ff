"""Multi-turn rollouts: agent loops over token-in-token-out generation, tools, tool-call parsers,
chat-template deltas, the sandbox the ``python`` tool runs code in, and the manager that turns many
conversations into one batch. The contracts are in :mod:`rlplat.contracts.agent`."""
