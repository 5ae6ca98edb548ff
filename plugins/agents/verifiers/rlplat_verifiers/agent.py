"""The agent function that trains a verifiers environment through the ``blackbox`` agent loop.

::

    agent.loop=blackbox
    agent.loops.blackbox.agent=rlplat_verifiers.agent:run
    agent.loops.blackbox.agent_kwargs={environment: "my_pkg.my_env:load_environment", environment_kwargs: {...}}

Per task, :func:`run` loads the environment ``environment`` names (a ``"module:function"`` returning a
``verifiers.Environment``, built once per process and keyword arguments), turns the rlplat row into a
verifiers rollout input (:func:`rollout_input`), and runs ``Environment.run_rollout``: the environment's
own rollout (its turns, its parser, its stop conditions) against the gateway's ``base_url`` through
verifiers' ``OpenAIChatCompletionsClient`` over an ``openai.AsyncOpenAI``, then the environment's rubric
(``Rubric.score_rollout``). The row's reward is the rubric's weighted sum; each reward function and metric
of the rubric is an agent metric (``verifiers/<name>``). The gateway records every token the environment
sampled, so the row trains exactly what the environment saw.

A rollout that verifiers ended in error (``state["error"]``: a refused request, a failed tool) raises, and
the ``blackbox`` loop trains nothing on the row; an empty or malformed reply of the policy
(:data:`POLICY_ERRORS`) keeps the rubric's score, counted in ``verifiers/invalid_response``. Each request
carries the environment's ``sampling_args`` (updated by ``agent_kwargs.sampling_args``) and ``model``; the
gateway samples with the run's settings unless ``agent.gateway.request_sampling`` lets them apply.

verifiers' classic stack (``import verifiers as vf``: ``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``,
``vf.ToolEnv``, ``vf.Rubric``) is what runs; it is the API of verifiers 0.3 (0.4 kept only its v1 stack).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from typing import Any, Iterator, Mapping, Optional

DEFAULT_ENVIRONMENT = "rlplat_verifiers.arithmetic:load_environment"
"""The environment :func:`run` loads when ``agent_kwargs`` names none: the demo's arithmetic task."""

POLICY_ERRORS = frozenset({"EmptyModelResponseError", "InvalidModelResponseError"})
"""verifiers' errors that are the policy's own output (an empty or malformed reply): the rubric's score
of the rollout stands (a reply that says nothing is a wrong answer to learn from), where any other error
fails the row."""

_environments: dict[str, Any] = {}
_loading = threading.Lock()


def load_environment(path: str, kwargs: Optional[Mapping[str, Any]] = None) -> Any:
    """The ``verifiers.Environment`` ``function(**kwargs)`` returns, for ``path`` = ``"module:function"``;
    built once per process and arguments. :class:`ValueError` or :class:`TypeError` naming the key to fix."""
    kwargs = dict(kwargs or {})
    key = f"{path}?{json.dumps(kwargs, sort_keys=True, default=str)}"
    with _loading:
        if key not in _environments:
            factory = _function(path)
            with _keep_signal_handlers():
                environment = factory(**kwargs)
            import verifiers as vf

            if not isinstance(environment, vf.Environment):
                raise TypeError(f"agent_kwargs.environment={path!r} returned a {type(environment).__name__}, "
                                f"not a verifiers Environment (vf.SingleTurnEnv, vf.MultiTurnEnv, ...)")
            _environments[key] = environment
        return _environments[key]


def rollout_input(task: Mapping[str, Any], environment: Any) -> dict:
    """The verifiers ``RolloutInput`` of an rlplat row: ``prompt`` the row's ``raw_prompt`` (the
    environment's ``system_prompt`` first when the row has no system message, as verifiers formats its own
    datasets), ``answer`` the row's ``reward_model.ground_truth`` as text, ``info`` its ``extra_info``,
    ``example_id`` ``extra_info.index`` (else 0)."""
    prompt = task.get("raw_prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"task uid {task.get('uid')!r} has no raw_prompt (a list of chat messages): "
                         f"a verifiers environment needs the row's chat prompt")
    prompt = [dict(message) for message in prompt]
    system_prompt = getattr(environment, "system_prompt", None)
    if system_prompt and prompt[0].get("role") != "system":
        prompt.insert(0, {"role": "system", "content": system_prompt})
    info = dict(task.get("extra_info") or {})
    ground_truth = (task.get("reward_model") or {}).get("ground_truth")
    example_id = info.get("index", 0)
    result = {"prompt": prompt, "example_id": int(example_id) if isinstance(example_id, (int, float)) else 0,
              "info": info}
    if ground_truth is not None:
        result["answer"] = ground_truth if isinstance(ground_truth, str) else json.dumps(ground_truth)
    return result


async def run(task: dict, base_url: str, api_key: str, environment: str = DEFAULT_ENVIRONMENT,
              environment_kwargs: Optional[Mapping[str, Any]] = None, model: str = "policy",
              sampling_args: Optional[Mapping[str, Any]] = None) -> dict:
    """One rollout of ``environment`` for ``task`` against ``base_url``; ``{"reward": the rubric's reward,
    "metrics": {"verifiers/<name>": value, "verifiers/truncated": 0 or 1, "verifiers/invalid_response": 0 or
    1}}``. See the module docstring."""
    import openai
    import verifiers as vf

    env = load_environment(environment, environment_kwargs)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        output = await env.run_rollout(rollout_input(task, env), vf.OpenAIChatCompletionsClient(client), model,
                                       {**env.sampling_args, **(sampling_args or {})})
    finally:
        await client.close()
    error = output.get("error")
    if error and error.get("error") not in POLICY_ERRORS:
        raise RuntimeError(f"the verifiers rollout of {environment} ended in error: {error}")
    metrics = {f"verifiers/{name}": float(value) for name, value in (output.get("metrics") or {}).items()}
    metrics["verifiers/truncated"] = float(bool(output.get("is_truncated")))
    metrics["verifiers/invalid_response"] = float(bool(error))
    return {"reward": float(output["reward"]), "metrics": metrics}


def _function(path: str) -> Any:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"agent_kwargs.environment must be \"module:function\", got {path!r}")
    from rlplat.registry import resolve_dotted_path

    try:
        target = resolve_dotted_path(path)
    except ImportError as error:
        raise ValueError(f"agent_kwargs.environment={path!r}: cannot import {module_name!r}: {error}") from None
    except AttributeError:
        raise ValueError(f"agent_kwargs.environment={path!r}: {module_name} has no {attribute!r}") from None
    if not callable(target):
        raise ValueError(f"agent_kwargs.environment={path!r} is a {type(target).__name__}, not a function")
    return target


class _NoHandlerInstalls:
    """The ``signal`` module as verifiers' environment module sees it while an environment is built off
    the main thread: ``signal.signal`` installs nothing (it would raise there)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(signal, name)

    @staticmethod
    def signal(signum: int, handler: Any) -> Any:
        return signal.getsignal(signum)


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """The process's SIGINT and SIGTERM handlers stay the rollout worker's: a verifiers ``Environment``
    installs its own when built (its teardown, then ``exit(143)`` on SIGTERM), which would replace the
    worker's shutdown, and ``signal.signal`` raises outside the main thread (an agent function run on a
    thread)."""
    if threading.current_thread() is threading.main_thread():
        saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in saved.items():
                if handler is not None:
                    signal.signal(signum, handler)
        return
    from verifiers.legacy.envs import environment as environment_module

    original = environment_module.signal
    environment_module.signal = _NoHandlerInstalls()
    try:
        yield
    finally:
        environment_module.signal = original
