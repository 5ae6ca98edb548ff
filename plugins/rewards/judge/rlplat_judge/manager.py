"""The generative judge: a reward manager (``reward.manager=judge``) that asks a judge model served by a
rollout engine to score each response, and the ``judge`` role whose worker group serves it.

**The role.** ``judge`` is enabled when ``reward.manager`` is ``judge``. Its worker is an
:class:`~rlplat.workers.actor_rollout_ref.ActorRolloutRefWorker` with the rollout role only (like the
separate ``rollout`` role), whose rollout (``reward.config.rollout``: ``hf``, ``vllm``, ``sglang`` or a
plugin's) loads the judge model from ``reward.config.model_path`` with its own weights. The trainer syncs
the policy's weights into the actor's and the ``rollout`` role's engines only, never into this group.
Placement: ``colocated`` (the default: a worker object in each of the actor's processes) or ``separate``
(``roles.judge.placement=separate``, a resource pool of its own; Ray only).

**The manager.** :class:`JudgeRewardManager` is built like every manager from ``(scorer, tokenizer,
config)``; the rule scorer is not used. The trainer hands it the worker groups through
:meth:`~rlplat.contracts.reward.RewardManager.bind_workers`; it takes the ``judge`` group. For each row it
renders the prompt template (``{question}``: the last user message of the row's ``raw_prompt``, else the
prompt tokens decoded with the policy's tokenizer; ``{response}``: the response up to its last valid token,
special tokens skipped; ``{ground_truth}``: the row's ``reward_model["ground_truth"]``), wraps it as one
user message in the judge tokenizer's chat template (``apply_chat_template``), tokenises it with the
judge's tokenizer, left padded, and generates with the judge's sampling settings. The registered parser
(kind ``judge_parser``, ``reward.config.parser``) reads the score from the decoded answer; when it cannot,
the row gets ``default_score`` and the failure is counted.

**Output** (as every reward manager's): ``token_level_scores`` [B, R] with the score at the last valid
response token; non-tensor ``judge_text`` (the judge's answer); ``meta_info["reward_metrics"]``:
``reward/judge/parse_failures`` (also reported as ``reward/errors``), ``reward/judge/truncated`` (judge
prompts cut to ``max_prompt_length``), ``reward/judge/score/mean|min|max`` and ``timing_s/reward_judge``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Literal, Optional

from rlplat.config_node import ConfigError, read_config_node, resolve_schema
from rlplat.contracts.reward import JudgeParser, RewardManager, split_score
from rlplat.contracts.role import Role, RunContext
from rlplat.registry import did_you_mean
from rlplat.kits.reward import last_tokens

if TYPE_CHECKING:
    from rlplat.controller.host import WorkerSpec
    from rlplat.protocol import DataProto

logger = logging.getLogger("rlplat_judge.manager")

ROLE = "judge"
PLACEHOLDERS = ("question", "response", "ground_truth")
PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
#: Keys of the judge rollout's node that come from this config, not from ``rollout_config``.
ROLLOUT_BUILD_KEYS = {"model_path": "reward.config.model_path", "load_weights": "the judge (its own weights are always loaded)"}

DEFAULT_TEMPLATE = """Rate how well the response answers the question, from 0 (wrong or useless) to 10 (correct and complete).

Question:
{question}

Response:
{response}

Reply with the rating only, written as <score>N</score>."""


@dataclasses.dataclass
class JudgeConfig:
    """The ``reward.config`` node of ``reward.manager=judge``: the judge model, the rollout that serves it,
    the prompt, how its answer becomes a score."""

    model_path: Optional[str] = None
    """Local Hugging Face directory of the judge model (required). It is loaded with its own weights and
    never receives the policy's."""
    tokenizer_path: Optional[str] = None
    """Directory of the judge's tokenizer (and chat template); defaults to ``model_path``."""
    rollout: str = "hf"
    """Registered rollout engine (kind ``rollout``) that serves the judge: ``hf``, ``vllm``, ``sglang``, ..."""
    rollout_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The judge rollout's own keys (``dtype``, ``device``, ``gpu_memory_utilization``, ...), checked against
    the schema that rollout registers; ``model_path`` and ``load_weights`` are set by the judge."""
    prompt_template: Optional[str] = None
    """The judge's prompt, with ``{response}`` and optionally ``{question}`` and ``{ground_truth}``
    (other braces are left as they are). None (and no ``prompt_template_path``): a 0-10 rating in
    ``<score>`` tags, for the default ``tagged`` parser."""
    prompt_template_path: Optional[str] = None
    """A file holding the prompt template instead (UTF-8); give this or ``prompt_template``, not both."""
    apply_chat_template: bool = True
    """Send the rendered prompt as one user message through the judge tokenizer's chat template (with the
    generation prompt); false: the text as it is, with the tokenizer's special tokens (e.g. BOS)."""
    parser: str = "tagged"
    """Registered judge parser (kind ``judge_parser``) that reads the score: ``number``, ``tagged``,
    ``yes_no`` or a plugin's."""
    parser_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The parser's own keys (e.g. ``min_score``, ``max_score``, ``pattern``), checked against its schema."""
    default_score: float = 0.0
    """Score of a row whose judge answer the parser cannot read (counted in ``reward/judge/parse_failures``);
    used as it is, not normalised."""
    normalize: bool = False
    """Map the parser's score range (e.g. ``[min_score, max_score]``) linearly onto [0, 1]; the parser must
    declare one."""
    greedy: bool = True
    """Take the judge's most likely tokens (deterministic scores); false samples at ``temperature``."""
    temperature: float = 1.0
    """Sampling temperature of the judge when ``greedy`` is false."""
    max_new_tokens: int = 64
    """Longest judge answer, in judge tokens; a longer one is cut (and usually fails to parse)."""
    max_prompt_length: int = 2048
    """Longest judge prompt, in judge tokens, after the chat template."""
    truncation: Literal["left", "middle", "error"] = "left"
    """What a longer judge prompt loses (counted in ``reward/judge/truncated``): ``left``, its first tokens
    (the end, with the instruction to answer and the generation prompt, stays); ``middle``, the tokens
    around its middle (its first and last halves stay: the question and the instruction, most of a long
    response is dropped); ``error``, nothing: the call raises, naming the row."""

    def __post_init__(self) -> None:
        if self.model_path is None:
            raise ValueError("model_path is not set: give the judge model's local Hugging Face directory "
                             "(reward.config.model_path=/path/to/judge)")
        for key in ("model_path", "tokenizer_path", "prompt_template_path"):
            # absolute: a worker process in a pool of its own need not share the driver's working directory
            if getattr(self, key) is not None:
                setattr(self, key, str(Path(getattr(self, key)).expanduser().absolute()))
        for key in ("model_path", "tokenizer_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).is_dir():
                raise ValueError(f"{key}: {value} is not a directory (a local Hugging Face model folder is expected)")
        self.template_text()
        build_parser(self.parser, self.parser_config, normalize=self.normalize)
        self.rollout_node()
        from rlplat.contracts.rollout import SamplingParams

        SamplingParams(**self.sampling())
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if not math.isfinite(self.default_score):
            raise ValueError(f"default_score must be a finite number, got {self.default_score}")

    def template_text(self) -> str:
        """The prompt template (inline, from its file, or the default), checked to hold ``{response}``."""
        if self.prompt_template is not None and self.prompt_template_path is not None:
            raise ValueError("prompt_template and prompt_template_path are both set: give one of them")
        if self.prompt_template_path is not None:
            path = Path(self.prompt_template_path)
            if not path.is_file():
                raise ValueError(f"prompt_template_path: {path} does not exist or is not a file")
            text = path.read_text(encoding="utf-8")
            where = f"the prompt template in {path}"
        else:
            text = DEFAULT_TEMPLATE if self.prompt_template is None else self.prompt_template
            where = "prompt_template"
        if "{response}" not in text:
            raise ValueError(f"{where} has no {{response}} placeholder, so the judge would never see the response; "
                             f"the placeholders are {', '.join('{' + name + '}' for name in PLACEHOLDERS)}")
        return text

    def rollout_node(self) -> dict[str, Any]:
        """What the judge rollout's factory receives, checked against the rollout's registered schema."""
        from rlplat.config import entry_schema

        reserved = sorted(set(self.rollout_config) & set(ROLLOUT_BUILD_KEYS))
        if reserved:
            raise ValueError(f"rollout_config.{reserved[0]} is set from {ROLLOUT_BUILD_KEYS[reserved[0]]}: remove it")
        node = {"model_path": self.model_path, "load_weights": True, **self.rollout_config}
        try:
            schema, owner = entry_schema("rollout", self.rollout, "rollout")
        except ConfigError as error:
            raise ValueError(str(error)) from None
        if schema is not None:
            try:
                read_config_node(node, schema, "reward.config.rollout_config")
            except ConfigError as error:
                raise ValueError(f"{error} [{owner}]") from None
        return node

    def sampling(self) -> dict[str, Any]:
        """The judge's :class:`~rlplat.contracts.rollout.SamplingParams` fields (one answer per prompt)."""
        return {"n": 1, "greedy": self.greedy, "temperature": self.temperature, "max_new_tokens": self.max_new_tokens}

    def worker_config(self) -> dict[str, Any]:
        """The rollout-only ``ActorRolloutRefWorker`` config that serves the judge."""
        return {"roles": ["rollout"], "rollout": self.rollout, "rollout_config": self.rollout_node(),
                "sampling": self.sampling(), "tokenizer_path": self.tokenizer_path or self.model_path}


def build_parser(name: str, config: Any = None, *, normalize: bool = False) -> JudgeParser:
    """The registered judge parser ``name`` built from ``config`` (read with the entry's schema); a
    ``ValueError`` that says what is wrong (unknown name, a bad key, no range to normalise with)."""
    from rlplat import registry
    from rlplat.registry import RegistryError

    try:
        entry = registry.entry("judge_parser", name)
    except RegistryError:
        names = registry.names("judge_parser")
        raise ValueError(f"parser: unknown judge parser {name!r}; the judge parsers are {', '.join(names) or 'none'}."
                         f"{did_you_mean(name, names)}") from None
    if entry.status != "ok":
        raise ValueError(f"parser: judge parser {name!r} is {entry.status}")
    schema = resolve_schema(entry.config_schema)
    try:
        node = read_config_node(config, schema, "reward.config.parser_config") if schema is not None else dict(config or {})
    except ConfigError as error:
        raise ValueError(f"{error} [judge parser {name!r} from {entry.origin}]") from None
    parser = entry.load()(node)
    if not isinstance(parser, JudgeParser):
        raise TypeError(f"judge parser {name!r} from {entry.origin} built a {type(parser).__name__}, not a JudgeParser")
    if normalize:
        bounds = parser.score_range()
        if bounds is None or not bounds[0] < bounds[1]:
            raise ValueError(f"normalize=true needs a score range, and judge parser {name!r} declares none "
                             f"(got {bounds}); set parser_config.min_score and max_score, or normalize=false")
    return parser


def render(template: str, values: Mapping[str, str]) -> str:
    """``template`` with each ``{question}``, ``{response}``, ``{ground_truth}`` replaced in one pass (a
    response that contains a placeholder is not expanded again); other braces stay."""
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def question_of(prompt: Any, row: int) -> str:
    """The question of a row's ``raw_prompt``: a string as it is; of chat messages, the last user
    message's content (all contents, one per line, when no message is the user's)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
        messages = list(prompt)
        if messages and all(isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in messages):
            users = [m["content"] for m in messages if m.get("role") == "user"]
            return users[-1] if users else "\n".join(m["content"] for m in messages)
    raise ValueError(f"row {row}: raw_prompt is {prompt!r:.80}, neither a string nor a list of {{'role', 'content'}} messages")


def decode_through(tokenizer: Any, tokens: Any, mask: Any) -> list[str]:
    """Each row of ``tokens`` up to its last valid token of ``mask``, special tokens skipped."""
    last = last_tokens(mask)
    return tokenizer.batch_decode([tokens[row, : end + 1].tolist() for row, end in enumerate(last)], skip_special_tokens=True)


class JudgeRewardManager(RewardManager):
    """See the module docstring. ``tokenizer`` is the policy's (it decodes the batch); the judge's own
    tokenizer is loaded from ``config.tokenizer_path`` or ``config.model_path``."""

    def __init__(self, scorer: Any, tokenizer: Any, config: Any = None):
        from transformers import AutoTokenizer

        from rlplat.kits.data import pad_token_id_of

        self.tokenizer = tokenizer
        self.settings = read_config_node(config, JudgeConfig, "reward.config")
        self.template = self.settings.template_text()
        self.parser = build_parser(self.settings.parser, self.settings.parser_config, normalize=self.settings.normalize)
        path = self.settings.tokenizer_path or self.settings.model_path
        self.judge_tokenizer = AutoTokenizer.from_pretrained(path)
        if self.settings.apply_chat_template and getattr(self.judge_tokenizer, "chat_template", None) is None:
            raise ValueError(f"reward.config.apply_chat_template is true, but the judge tokenizer in {path} has no chat "
                             "template: set reward.config.apply_chat_template=false to send the prompt as plain text")
        self.pad_token_id = pad_token_id_of(self.judge_tokenizer)
        self.group = None

    def bind_workers(self, groups: Mapping[str, Any]) -> None:
        if ROLE not in groups:
            raise RuntimeError(f"the judge reward manager scores through the {ROLE!r} worker group, which this run did not "
                               f"build (groups: {', '.join(groups) or 'none'}); the {ROLE!r} role is enabled by "
                               "reward.manager=judge")
        self.group = groups[ROLE]

    def __call__(self, batch: "DataProto") -> "DataProto":
        if self.group is None:
            raise RuntimeError("the judge reward manager has no judge worker group: call bind_workers(groups) with the "
                               "run's worker groups first (the trainer does it after building them)")
        started = time.perf_counter()
        responses, mask = batch.batch["responses"], batch.batch["response_mask"]
        if responses.shape != mask.shape:
            raise ValueError(f"responses {tuple(responses.shape)} and response_mask {tuple(mask.shape)} differ in shape")
        prompts, truncated = self.judge_prompts(batch)
        answers = self.ask(prompts) if len(batch) else []
        scores, failures = [], 0
        for row, answer in enumerate(answers):
            try:
                score, _ = split_score(self.parser.parse(answer), where=f"judge parser {self.settings.parser!r}")
            except ValueError as error:
                failures += 1
                if failures == 1:
                    logger.warning("judge answer of row %d could not be read (%s); it gets reward.config.default_score=%s and "
                                   "is counted in reward/judge/parse_failures", row, error, self.settings.default_score)
                scores.append(float(self.settings.default_score))
                continue
            if self.settings.normalize:
                low, high = self.parser.score_range()
                score = (score - low) / (high - low)
            scores.append(score)
        return self.output(batch, scores, answers, failures, truncated, time.perf_counter() - started)

    def judge_prompts(self, batch: "DataProto") -> tuple[list[list[int]], int]:
        """The judge's prompt token ids per row, cut to ``max_prompt_length``, and how many were cut."""
        values: dict[str, list[str]] = {"response": decode_through(self.tokenizer, batch.batch["responses"], batch.batch["response_mask"])}
        if "{question}" in self.template:
            values["question"] = self.questions(batch)
        if "{ground_truth}" in self.template:
            values["ground_truth"] = self.ground_truths(batch)
        prompts, truncated = [], 0
        for row in range(len(batch)):
            text = render(self.template, {key: column[row] for key, column in values.items()})
            if self.settings.apply_chat_template:
                text = self.judge_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                                tokenize=False)
            ids = list(self.judge_tokenizer(text, add_special_tokens=not self.settings.apply_chat_template)["input_ids"])
            if len(ids) > self.settings.max_prompt_length:
                ids = self.truncate(ids, row)
                truncated += 1
            prompts.append(ids)
        return prompts, truncated

    def truncate(self, ids: list[int], row: int) -> list[int]:
        limit, policy = self.settings.max_prompt_length, self.settings.truncation
        if policy == "error":
            raise ValueError(f"row {row}: the judge prompt has {len(ids)} tokens, over reward.config.max_prompt_length={limit} "
                             "(reward.config.truncation=error); raise the limit or choose truncation=left or middle")
        if policy == "left":
            return ids[-limit:]
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head):]

    def questions(self, batch: "DataProto") -> list[str]:
        """Each row's question: from ``raw_prompt`` when the batch carries it, else its prompt tokens decoded."""
        raw = batch.non_tensor_batch.get("raw_prompt")
        if raw is not None:
            return [question_of(prompt, row) for row, prompt in enumerate(raw)]
        if "prompts" not in batch.batch.keys():
            raise ValueError("the judge prompt template uses {question}, and the batch has neither a raw_prompt column "
                             "nor prompts tokens to read the question from")
        prompts = batch.batch["prompts"]
        if "attention_mask" in batch.batch.keys():
            mask = batch.batch["attention_mask"][:, : prompts.shape[1]]
        else:
            mask = prompts != self.tokenizer.pad_token_id
        return [self.tokenizer.decode(prompts[row][mask[row].bool()].tolist(), skip_special_tokens=True) for row in range(len(batch))]

    @staticmethod
    def ground_truths(batch: "DataProto") -> list[str]:
        reward_models = batch.non_tensor_batch.get("reward_model")
        plain = batch.non_tensor_batch.get("ground_truth")
        truths = []
        for row in range(len(batch)):
            value = reward_models[row] if reward_models is not None else None
            truth = value.get("ground_truth") if isinstance(value, Mapping) else (plain[row] if plain is not None else None)
            if truth is None:
                raise ValueError(f"row {row}: the judge prompt template uses {{ground_truth}}, and the row has none "
                                 "(reward_model.ground_truth)")
            truths.append(str(truth))
        return truths

    def ask(self, prompts: list[list[int]]) -> list[str]:
        """The judge's decoded answers to ``prompts``, through the judge group's ``generate_sequences``."""
        from rlplat.kits.data import left_padded
        from rlplat.protocol import DataProto

        request = DataProto.from_dict(left_padded(prompts, self.pad_token_id), meta_info=self.settings.sampling())
        output = self.group.generate_sequences(request)
        return decode_through(self.judge_tokenizer, output.batch["responses"], output.batch["response_mask"])

    def output(self, batch: "DataProto", scores: list[float], answers: list[str], failures: int, truncated: int,
               seconds: float) -> "DataProto":
        import numpy as np
        import torch

        from rlplat.protocol import DataProto

        token_level_scores = torch.zeros(batch.batch["responses"].shape, dtype=torch.float32)
        for row, (end, score) in enumerate(zip(last_tokens(batch.batch["response_mask"]), scores)):
            if end >= 0:
                token_level_scores[row, end] = score
        metrics = {"reward/judge/parse_failures": float(failures), "reward/errors": float(failures),
                   "reward/judge/truncated": float(truncated), "timing_s/reward_judge": seconds}
        if scores:
            metrics.update({"reward/judge/score/mean": float(np.mean(scores)), "reward/judge/score/min": float(min(scores)),
                            "reward/judge/score/max": float(max(scores))})
        return DataProto.from_dict(tensors={"token_level_scores": token_level_scores},
                                   non_tensors={"judge_text": np.asarray(answers, dtype=object)},
                                   meta_info={"reward_metrics": metrics})


class JudgeRole(Role):
    """The judge model's rollout, in the actor's processes (default) or a pool of its own."""

    def enabled(self, run: RunContext) -> bool:
        return run.config.reward.manager == "judge"

    def worker(self, run: RunContext) -> "WorkerSpec":
        from rlplat import registry
        from rlplat.controller.host import WorkerSpec
        from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

        settings = read_config_node(run.config.reward.config, JudgeConfig, "reward.config")
        if registry.entry("rollout", settings.rollout).needs_gpu and not run.config.cluster.use_gpu:
            raise ConfigError(f"reward.config.rollout: the judge's rollout {settings.rollout!r} runs on GPUs only: set "
                              "cluster.use_gpu=true, or serve the judge with the hf rollout on CPUs")
        return WorkerSpec(ActorRolloutRefWorker, settings.worker_config())


def role() -> Role:
    return JudgeRole()


def check_run(run: RunContext) -> None:
    """At config validation (the ``judge`` role's ``metadata["check"]``): a judge rollout that runs on GPUs
    only is refused on a CPU run."""
    from rlplat import registry
    from omegaconf import OmegaConf

    if run.config.reward.manager != "judge":
        return
    judge_rollout = (OmegaConf.to_container(run.config.reward.config, resolve=True) or {}).get("rollout", "hf")
    if registry.entry("rollout", judge_rollout).needs_gpu and not run.config.cluster.use_gpu:
        raise ConfigError(f"reward.config.rollout: the judge's rollout {judge_rollout!r} runs on GPUs only: set "
                          "cluster.use_gpu=true, or serve the judge with the hf rollout on CPUs.")
