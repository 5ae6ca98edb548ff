"""``trainer.profile``: a Chrome-trace timeline of chosen steps, for the driver and every worker process.

For each step in ``trainer.profile.steps`` the run writes ``<dir>/step_<N>.trace.json`` (``dir`` defaults to
``run_dir/profile``): the step's span on the driver, tiled by its phases (``gen`` with ``reward`` inside it,
``old_log_prob``, ``ref``, ``values``, ``adv``, ``update_critic``, ``update_actor``, ``sync_weights``,
``validate``, ``save``; ``driver`` for the driver's own work between them), each worker process's remote calls
(``actor.update_actor``, ``actor.generate_sequences``, ...) with what they wrap, and the run sentinel's reports
of the step as instant events; all on one clock (:mod:`rlplat.controller.timeline`). With
``trainer.profile.torch=true`` every worker process also writes a ``torch.profiler`` trace of the step,
``<dir>/step_<N>/torch_rank<R>_pid<P>.json``. ``rlplat plot RUN_DIR`` draws each trace as a timeline PNG.
Recording costs one wall-clock read per span; steps not profiled record nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable, List, Optional

from rlplat.contracts.observer import ObservedRun, StepObserver
from rlplat.controller import timeline


@dataclasses.dataclass
class ProfileConfig:
    """The ``trainer.profile`` node."""

    steps: List[int] = dataclasses.field(default_factory=list)
    """Steps (from 1) whose timeline is written."""
    torch: bool = False
    """Also a ``torch.profiler`` trace per worker process of each profiled step."""
    dir: Optional[str] = None
    """Where the traces go; None: ``<trainer.output_dir>/profile``."""

    def __post_init__(self) -> None:
        bad = [step for step in self.steps if not isinstance(step, int) or isinstance(step, bool) or step < 1]
        if bad:
            raise ValueError(f"steps are step numbers from 1, got {bad}")


class StepProfiler:
    """Writes the traces of one run (see the module docstring)."""

    def __init__(self, settings: ProfileConfig, run_dir: Path):
        self.settings = settings
        self.directory = Path(settings.dir) if settings.dir else Path(run_dir) / "profile"
        self.backends: list[Any] = []

    def due(self, step: int) -> bool:
        return step in self.settings.steps

    def torch_dir(self, step: int) -> str | None:
        return str(self.directory / f"step_{step}") if self.settings.torch else None

    def begin(self, step: int, groups: Iterable[Any]) -> None:
        """Start recording in this process and in every worker process of ``groups``."""
        self.backends = list({id(group.backend): group.backend for group in groups}.values())
        timeline.start()
        for backend in self.backends:
            backend.host_calls("profile", True, self.torch_dir(step))

    def end(self, step: int, events: Iterable[dict[str, Any]]) -> Path:
        """Stop recording everywhere; write and return the step's trace. ``events``: the sentinel's reports."""
        processes: dict[int, str] = {os.getpid(): "driver"}
        spans: list[dict[str, Any]] = []
        for backend in self.backends:
            for report in backend.host_calls("profile", False, self.torch_dir(step)):
                spans.extend(report["spans"])
                name = f"{'+'.join(report['roles'])} rank {report['rank']}"
                processes[report["pid"]] = f"driver, {name}" if report["pid"] == os.getpid() else name
        spans.extend(timeline.stop())
        instants = [{"name": f"{event['error']}", "time": event["time"], "args": event} for event in events
                    if event.get("step") == step]
        trace = timeline.chrome_trace(spans, processes, instants, {"step": step})
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step}.trace.json"
        temporary = path.with_suffix(".partial")
        temporary.write_text(json.dumps(trace, default=str))
        os.replace(temporary, path)
        return path


class ProfileObserver(StepObserver):
    """The profiler as a step observer (kind ``step_observer``, registered by rlplat): it starts recording when a
    profiled step begins and writes the trace once the step is done (also when it failed), with the sentinel's
    events of that step."""

    def __init__(self, run: ObservedRun, settings: ProfileConfig):
        self.run = run
        self.profiler = StepProfiler(settings, run.run_dir)
        self.recording = False

    def on_stage(self, name: str, batch: Any, metrics: dict[str, Any]) -> None:
        step = self.run.step
        if name == "step" and self.profiler.due(step):
            self.profiler.begin(step, self.run.groups.values())
            self.recording = True
        elif name == "step_done" and self.recording:
            self.stop()

    def finish(self, state: str, error: BaseException | None = None) -> None:
        if self.recording:  # the run ended inside a profiled step: its trace so far, and recording stops
            self.stop()

    def stop(self) -> None:
        self.recording = False
        self.profiler.end(self.run.step, getattr(self.run.observers.get("sentinel"), "recent", ()))


def observer(run: ObservedRun) -> ProfileObserver | None:
    """The profiler of a run whose ``trainer.profile.steps`` names any step."""
    from rlplat.config_node import read_config_node

    settings = read_config_node(run.node["trainer"]["profile"], ProfileConfig, "trainer.profile")
    return ProfileObserver(run, settings) if settings.steps else None

