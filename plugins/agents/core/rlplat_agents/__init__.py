"""rlplat-agents: multi-turn rollouts for rlplat. Agent loops (``single_turn``, ``tool``, ``env``), the
manager that runs them in a rollout worker (the ``agent_loops`` rollout driver), chat-template deltas and
``rlplat check-template``, the tools file and the ``calculator`` tool, the ``hermes`` tool-call parser and
the ``retry`` environment. The contracts they implement are core's (:mod:`rlplat.contracts.agent`)."""
