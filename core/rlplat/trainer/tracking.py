"""Where training metrics go: the console, ``metrics.jsonl``, TensorBoard and Weights & Biases.

The trainer owns one :class:`Tracker` and calls ``log(metrics, step)`` once per step. Metric names are
the field's (verl's): ``critic/score/mean``, ``actor/pg_loss``, ``actor/ppo_kl``, ``timing_s/step``,
``val/...``. Step numbers are the trainer's, 1 for the first training step; ``total_steps`` is the last
one. Each backend imports its heavy package (torch, tensorboard, wandb) only when it is requested, and a
missing package fails at construction, before training starts, not at the first step.

A run directory holds::

    metrics.jsonl    one JSON object per logged step: {"step": N, "time": unix seconds, name: value, ...}
    tensorboard/     event files (backend "tensorboard")
    wandb/           the wandb run, offline unless an API key is configured (backend "wandb")
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from rlplat.config.trainer import LOGGER_BACKENDS
from rlplat.registry import did_you_mean

__all__ = [
    "BACKENDS",
    "BackendPackageMissing",
    "Tracker",
    "format_duration",
    "read_metrics",
    "wandb_mode",
]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
REWARD_METRICS = ("critic/score/mean", "critic/rewards/mean")
KL_METRICS = ("actor/ppo_kl", "actor/kl_loss")
STEP_TIME_METRIC = "timing_s/step"
VALIDATION_PREFIX = "val/"
# Median over this many recent steps: the first steps (compilation, cache warm-up) stop weighing on the
# ETA after a few steps, and a slowdown shows within a few more.
ETA_WINDOW = 20


class BackendPackageMissing(ImportError):
    """A requested logging backend needs a package that is not installed."""


def format_duration(seconds: float) -> str:
    """``45`` -> ``"45s"``, ``273`` -> ``"4m33s"``, ``3720`` -> ``"1h02m"``, ``183600`` -> ``"2d03h"``.

    Rounds to whole seconds; a negative or non-finite duration (no estimate yet) is ``"?"``.
    """
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    total = round(seconds)
    minutes, secs = divmod(total, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _format_number(value: float) -> str:
    return f"{value:.3g}"


def _metric_value(name: str, value: Any, step: int) -> float:
    """One number per metric: a list gathered from workers is averaged; numpy and 0-d torch values are
    unwrapped through ``tolist()``."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"metric {name!r} at step {step} is an empty list: there is nothing to average")
        numbers = [_metric_value(name, item, step) for item in value]
        return sum(numbers) / len(numbers)
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(
        f"metric {name!r} at step {step} is a {type(value).__name__} ({value!r}); "
        "log a number or a list of numbers (one per worker)"
    )


# -- JSONL -----------------------------------------------------------------------------------------------


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, in file order; non-finite values (``null`` in the file)
    come back as NaN. A torn last line (a run killed while writing it) is skipped; a bad line elsewhere
    is an error naming the file and line."""
    path = Path(run_dir) / METRICS_FILE
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON object ({error})") from None
        records.append({key: math.nan if value is None else value for key, value in record.items()})
    return records


def _drop_stale_lines(path: Path, start_step: int) -> None:
    """Rewrite ``path`` without the records at or past ``start_step``: a killed run's steps after its last
    checkpoint, which the resumed run logs again. Also drops lines that do not parse (a torn last
    line). Written to a temporary file and renamed over, so a crash here leaves one file or the other."""
    kept, dropped = [], 0
    with path.open() as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                dropped += 1
                continue
            if step >= start_step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if not dropped:
        return
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as out:
        out.writelines(kept)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    logger.info("%s: dropped %d line(s) at or past step %d left by an earlier run", path, dropped, start_step)


class JsonlBackend:
    """Appends one line per ``log`` to ``run_dir/metrics.jsonl`` and flushes it, so a killed run loses at
    most the step it was writing. NaN and infinities are written as ``null`` (JSON has neither)."""

    reserved = ("step", "time")

    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.path = run_dir / METRICS_FILE
        if self.path.exists():
            _drop_stale_lines(self.path, start_step)
        self._file = self.path.open("a")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        clashes = [name for name in self.reserved if name in metrics]
        if clashes:
            raise ValueError(f"metric name(s) {clashes} clash with the fields metrics.jsonl adds; rename them")
        record = {"step": step, "time": round(time.time(), 3)}
        record.update((name, value if math.isfinite(value) else None) for name, value in metrics.items())
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# -- TensorBoard ------------------------------------------------------------------------------------------


class TensorBoardBackend:
    """Scalars in ``run_dir/tensorboard`` through torch's ``SummaryWriter``, flushed every step. Events
    at or past ``start_step`` that an earlier run left are purged (TensorBoard hides them on reading)."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        try:
            import tensorboard  # noqa: F401  (torch's writer needs it; check it ourselves for a clear message)
        except ImportError:
            raise BackendPackageMissing(
                "the 'tensorboard' logging backend needs the tensorboard package, which is not installed: "
                "run `pip install tensorboard`, or drop 'tensorboard' from trainer.logger"
            ) from None
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=start_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# -- Weights & Biases -------------------------------------------------------------------------------------


def wandb_mode(environ: Mapping[str, str] | None = None) -> str:
    """The mode the wandb backend runs in: ``WANDB_MODE`` when it is set (``online``, ``offline``,
    ``disabled``); otherwise ``online`` when an API key is configured (``WANDB_API_KEY``, or an entry for
    the wandb host, ``WANDB_BASE_URL`` or api.wandb.ai, in ``NETRC`` or ``~/.netrc``), else ``offline``.
    Offline runs need no network; ``wandb sync run_dir/wandb/offline-run-*`` uploads them later."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if environ.get("WANDB_API_KEY"):
        return "online"
    return "online" if _netrc_has_wandb_entry(environ) else "offline"


def _netrc_has_wandb_entry(environ: Mapping[str, str]) -> bool:
    import netrc
    from urllib.parse import urlparse

    host = urlparse(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(environ.get("NETRC", "~/.netrc")).expanduser()
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _plain_config(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    return dict(config)


class WandbBackend:
    """A wandb run under ``run_dir/wandb`` with ``config`` as its run config; mode from
    :func:`wandb_mode`."""

    def __init__(self, run_dir: Path, project: str, experiment: str | None, config: Any) -> None:
        try:
            import wandb
        except ImportError:
            raise BackendPackageMissing(
                "the 'wandb' logging backend needs the wandb package, which is not installed: "
                "run `pip install wandb`, or drop 'wandb' from trainer.logger"
            ) from None
        self.mode = wandb_mode()
        self._run = wandb.init(
            project=project, name=experiment, config=_plain_config(config), dir=str(run_dir), mode=self.mode
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


# -- console ----------------------------------------------------------------------------------------------


class ConsoleBackend:
    """Progress on ``stream`` (stderr by default): a rich progress bar on a terminal, otherwise one compact
    line per step, readable in CI logs::

        step 12/100 | reward 0.41 | kl 0.002 | 3.1 s/step | ETA 4m33s

    ``reward`` is ``critic/score/mean`` (else ``critic/rewards/mean``), ``kl`` is ``actor/ppo_kl`` (else
    ``actor/kl_loss``); each is left out when the step has neither. The step time is ``timing_s/step``,
    or the wall time since the previous ``log`` when the trainer does not report it; the ETA is the
    median of the recent step times times the steps left. Validation metrics (``val/...``) get a line
    of their own.
    """

    def __init__(self, stream: TextIO | None, total_steps: int | None, start_step: int) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total_steps = total_steps
        self.step_times: deque[float] = deque(maxlen=ETA_WINDOW)
        self._last_log = time.monotonic()
        self._progress = None
        if self.stream.isatty() and os.environ.get("TERM") != "dumb":
            self._start_progress(max(start_step - 1, 0))

    def _start_progress(self, completed: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self._progress = Progress(
            BarColumn(),
            TextColumn("{task.fields[line]}", markup=False),
            console=Console(file=self.stream, force_terminal=True),
            # Redrawn at each log: a refresh thread would only redraw the same numbers between steps.
            auto_refresh=False,
        )
        self._task = self._progress.add_task("train", total=self.total_steps, completed=completed, line="")
        self._progress.start()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = time.monotonic()
        elapsed, self._last_log = now - self._last_log, now
        validation = {name: value for name, value in metrics.items() if name.startswith(VALIDATION_PREFIX)}
        if len(validation) < len(metrics):
            step_time = metrics.get(STEP_TIME_METRIC, elapsed)
            if math.isfinite(step_time):
                self.step_times.append(step_time)
            self._show_step(self.step_line(metrics, step), step)
        if validation:
            parts = [f"step {step} validation"] + [f"{name} {_format_number(v)}" for name, v in validation.items()]
            self._print(" | ".join(parts))

    def step_line(self, metrics: Mapping[str, float], step: int) -> str:
        parts = [f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"]
        for label, names in (("reward", REWARD_METRICS), ("kl", KL_METRICS)):
            present = [metrics[name] for name in names if name in metrics]
            if present:
                parts.append(f"{label} {_format_number(present[0])}")
        if self.step_times:
            step_time = statistics.median(self.step_times)
            parts.append(f"{_format_number(step_time)} s/step")
            if self.total_steps:
                parts.append(f"ETA {format_duration(step_time * max(self.total_steps - step, 0))}")
        return " | ".join(parts)

    def _show_step(self, line: str, step: int) -> None:
        if self._progress is None:
            self._print(line)
        else:
            self._progress.update(self._task, completed=step, line=line)
            self._progress.refresh()

    def _print(self, line: str) -> None:
        if self._progress is None:
            print(line, file=self.stream, flush=True)
        else:
            self._progress.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


# -- the tracker ------------------------------------------------------------------------------------------

BACKENDS = LOGGER_BACKENDS


class Tracker:
    """Sends each step's metrics to every requested backend (``trainer.logger``).

    - ``run_dir``: the run's output directory, created if missing.
    - ``backends``: names from :data:`BACKENDS`, or one comma-separated string. An unknown name is a
      ``ValueError`` raised before any backend starts.
    - ``total_steps``: the last step, for the progress bar and the ETA; ``None`` when unknown.
    - ``start_step``: the first step this run logs. Records at or past it in ``metrics.jsonl`` and
      TensorBoard are left from an earlier run (a killed run's steps after its last checkpoint; for a
      fresh run, 0, every record of an earlier run in the same directory) and are dropped, so the
      file keeps one line per step.
    - ``project``, ``experiment``, ``config``: the wandb project, run name and run config.
    - ``console``: the stream the console backend writes to, stderr by default.

    ``log`` takes one number per metric; a list (gathered from workers) is averaged. NaN and infinities
    are logged as they are and counted in ``nonfinite_counts`` (name -> steps), with a warning the
    first time each metric has one. Use as a context manager, or call ``close``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        backends: Iterable[str] | str = ("console", "jsonl", "tensorboard"),
        total_steps: int | None = None,
        start_step: int = 0,
        project: str = "rlplat",
        experiment: str | None = None,
        config: Any = None,
        console: TextIO | None = None,
    ) -> None:
        if isinstance(backends, str):
            backends = [name.strip() for name in backends.split(",") if name.strip()]
        names = list(dict.fromkeys(backends))
        for name in names:
            if name not in BACKENDS:
                raise ValueError(
                    f"unknown logging backend {name!r}; the backends are: {', '.join(BACKENDS)}.{did_you_mean(name, BACKENDS)}"
                )
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.nonfinite_counts: dict[str, int] = {}
        self.backends: dict[str, Any] = {}
        self._closed = False
        factories = {
            "console": lambda: ConsoleBackend(console, total_steps, start_step),
            "jsonl": lambda: JsonlBackend(self.run_dir, start_step),
            "tensorboard": lambda: TensorBoardBackend(self.run_dir, start_step),
            "wandb": lambda: WandbBackend(self.run_dir, project, experiment, config),
        }
        try:
            for name in names:
                self.backends[name] = factories[name]()
        except BaseException:
            self.close()
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics (name -> number, or a list of numbers to average)."""
        if self._closed:
            raise RuntimeError(f"log(step={step}) on a closed Tracker")
        step = operator.index(step)
        values = {name: _metric_value(name, value, step) for name, value in metrics.items()}
        for name, value in values.items():
            if not math.isfinite(value):
                if name not in self.nonfinite_counts:
                    logger.warning(
                        "metric %s is %s at step %d; logged as is (null in metrics.jsonl)", name, value, step
                    )
                self.nonfinite_counts[name] = self.nonfinite_counts.get(name, 0) + 1
        for backend in self.backends.values():
            backend.log(values, step)

    def close(self) -> None:
        """Close every backend (idempotent); the first error is raised after all were tried."""
        if self._closed:
            return
        self._closed = True
        first_error = None
        for backend in reversed(list(self.backends.values())):
            try:
                backend.close()
            except Exception as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
