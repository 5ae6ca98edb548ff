#!/usr/bin/env python3
"""One prepared check of rlplat's GPU path, for a bare machine with one CUDA GPU (``make gpu-check``).

Without a CUDA GPU it refuses with one line and exit code 2, before it installs or runs anything.
With one it

1. installs what the machine lacks (and a setuptools older than 77, a peft older than 0.21.2) from the wheels in ``--wheels``
   (``make gpu-check-wheels`` downloads them where there is network: constraints/gpu-check.txt) with
   ``pip --no-index``, then rlplat and its built-in plugins from this checkout (editable, ``--no-deps
   --no-build-isolation``: Ray is not needed and not there);
2. runs every check of :mod:`gpu_check_cases` in a process of its own (a fresh CUDA context each, so peak
   memory is the check's own, and a crash or a hang fails that check alone), within a time budget;
3. writes ``gpu-check.json`` (one line per check: status, figure, values, seconds) and ``gpu-check.log``
   (everything the checks printed) into ``--out``, and prints a summary table; what the checks write
   besides (the demo's run, pytest's XML) goes to ``--work``, so ``--out`` holds those two files alone.

Exit code: 0 when every check passed, 1 when one failed or did not run, 2 when it refused.
``--cpu-smoke`` runs the same checks at toy sizes on the CPU with what is installed: it tests this script,
not the GPU path (its figures mean nothing).

    python3 scripts/gpu_check.py [--out runs/gpu-check] [--wheels .gpu-wheels] [--only NAME,...]

Only the standard library is imported at module level, so it refuses cleanly where torch is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
REPORT_FILE = "gpu-check.json"
LOG_FILE = "gpu-check.log"
DEFAULT_BUDGET_S = 470.0
STATUSES = ("pass", "fail", "error", "timeout", "not run")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    description: str
    timeout_s: float
    """The most it may take on the GPU machine; it gets less when the budget has less left."""
    minimum_s: float
    """Not started with less than this left of the budget (it could not finish)."""


#: In the order they run: the most telling first, so that a tight budget drops the least.
CHECKS = (
    Check("doctor", "rlplat doctor exits 0 (versions, devices, plugins, no forbidden combination)", 60, 10),
    Check("fsdp2-precision", "fsdp2 on CUDA, NCCL, one rank: bf16 params + fp32 reduce vs fp32, loss per step", 120, 30),
    Check("rollout-sleep", "hf rollout on CUDA: sleep() frees the weights; wake_up + sync gives the same samples", 90, 20),
    Check("logprob-parity", "rollout vs training log-probs of the same tokens, bf16 (fp32 as control)", 90, 20),
    Check("throughput", "actor update of a random-init 0.5B Qwen2 at 16 x 2048: tokens/s, MFU (measured and datasheet peaks), "
          "profile; compiled layers; fused vs unfused head", 200, 60),
    Check("throughput-1.5b", "actor update of a random-init 1.5B Qwen2 at 16 x 2048: MFU against 35%", 100, 40),
    Check("fsdp2-offload", "fsdp2 parameter / optimizer offload on and off: memory held between steps, peak", 150, 40),
    Check("pytest-gpu", "the gpu-marked tests (pytest -m gpu)", 120, 20),
    Check("demo", "the demo task trained on the GPU for a fixed number of steps: validation accuracy rises", 240, 60),
    Check("throughput-long", "actor update of the 0.5B Qwen2 at 4k and 8k tokens a row", 90, 40),
)
CHECK_NAMES = tuple(check.name for check in CHECKS)


def checkout_packages() -> list[Path]:
    """What is installed from this checkout: rlplat first (its plugins need it), then every built-in
    plugin (``plugins/<name>/pyproject.toml`` and ``plugins/<kind>/<name>/pyproject.toml``, as ``make
    setup`` finds them)."""
    found = [*REPO.glob("plugins/*/pyproject.toml"), *REPO.glob("plugins/*/*/pyproject.toml")]
    return [REPO] + sorted(path.parent for path in found)


# -- report lines ------------------------------------------------------------------------------------------


def line(check: str, name: str, passed: bool | None, figure: str, **values: Any) -> dict[str, Any]:
    """One report line: ``passed`` True / False, or None for a line that is information only."""
    status = "info" if passed is None else ("pass" if passed else "fail")
    return {"check": check, "name": name, "status": status, "figure": figure, "values": values}


def failure_line(check: str, status: str, figure: str, seconds: float | None = None, **values: Any) -> dict[str, Any]:
    """A line for a check that produced no result of its own: ``error``, ``timeout`` or ``not run``."""
    if status not in STATUSES[2:]:
        raise ValueError(f"failure_line: status must be one of {STATUSES[2:]}, got {status!r}")
    record = {"check": check, "name": check, "status": status, "figure": figure, "values": values}
    if seconds is not None:
        record["seconds"] = round(seconds, 1)
    return record


def overall(lines: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Counts of each status over the report's lines (``info`` lines count as neither)."""
    counts = {status: 0 for status in (*STATUSES, "info")}
    for record in lines:
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    return counts


def exit_code(lines: Sequence[dict[str, Any]]) -> int:
    """0 when at least one line passed and none failed, errored, timed out or was left out; else 1."""
    counts = overall(lines)
    bad = sum(counts[status] for status in STATUSES[1:])
    return 0 if counts["pass"] and not bad else 1


def summary_table(lines: Sequence[dict[str, Any]], width: int = 120) -> str:
    """A plain-text table: one row per line (name, status, figure, seconds), then the counts."""
    rows = [(record["name"], record["status"].upper(), record["figure"],
             "" if record.get("seconds") is None else f"{record['seconds']:.0f}s") for record in lines]
    name_width = max([len("check")] + [len(row[0]) for row in rows])
    status_width = max([len("status")] + [len(row[1]) for row in rows])
    figure_width = max(20, width - name_width - status_width - 12)
    out = [f"{'check':<{name_width}}  {'status':<{status_width}}  {'figure':<{figure_width}}  time",
           f"{'-' * name_width}  {'-' * status_width}  {'-' * figure_width}  ----"]
    for name, status, figure, seconds in rows:
        wrapped = wrap(figure, figure_width)
        out.append(f"{name:<{name_width}}  {status:<{status_width}}  {wrapped[0]:<{figure_width}}  {seconds}".rstrip())
        out += [f"{'':<{name_width}}  {'':<{status_width}}  {more}".rstrip() for more in wrapped[1:]]
    counts = overall(lines)
    out.append(", ".join(f"{counts[status]} {status}" for status in (*STATUSES, "info") if counts[status]))
    return "\n".join(out)


def wrap(text: str, width: int) -> list[str]:
    words, pieces, current = text.split(), [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > width:
            pieces.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return pieces + [current] if current or not pieces else pieces


def write_report(path: Path, lines: Sequence[dict[str, Any]], environment: dict[str, Any], started: float, finished: float) -> dict[str, Any]:
    """Write the JSON report (atomically: a reader never sees half of it) and return it."""
    report = {
        "started": iso(started), "finished": iso(finished), "wall_s": round(finished - started, 1),
        "environment": environment, "counts": overall(lines), "exit_code": exit_code(lines), "checks": list(lines),
    }
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(report, indent=2, default=str) + "\n")
    partial.replace(path)
    return report


def iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds")


# -- refusing without a GPU --------------------------------------------------------------------------------


def gpu_problem() -> str | None:
    """Why this machine cannot run the check (one line), or None when it has a usable CUDA GPU."""
    try:
        import torch
    except ImportError:
        return "torch is not installed for this Python (" + sys.executable + ")"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        return f"no CUDA GPU is visible (torch {torch.__version__}, {build})"
    return None


# -- installing from the carried wheels --------------------------------------------------------------------


WHEEL_NAME = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[A-Za-z0-9_.+!]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def wheel_distribution(path: Path) -> tuple[str, str]:
    """``(normalised distribution name, version)`` from a wheel's file name (PEP 427)."""
    match = WHEEL_NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path}: not a wheel file name (name-version-python-abi-platform.whl)")
    return normalise(match["name"]), match["version"]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_key(version: str) -> tuple:
    """A sort key for plain release versions (``84.2.1``, ``2.11.0+cu130``): numbers compare as numbers,
    anything after the release (local or pre-release parts) is ignored."""
    release = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in release.group(0).split(".")) if release else ()


#: Installed versions older than these are replaced from the wheels: rlplat's pyproject.toml gives its
#: license as an SPDX string, which setuptools reads from 77 on; the fsdp2 engine requires peft 0.21.2 (the
#: GPU image had 0.21.0, which `rlplat doctor` rightly refused). Anything else present is kept as it is
#: (replacing the machine's pytest would break the pytest plugins installed beside it).
MINIMUM_VERSIONS = {"setuptools": "77", "peft": "0.21.2"}


def wheels_to_install(wheels: Iterable[Path], installed: dict[str, str], minimums: dict[str, str] = MINIMUM_VERSIONS) -> list[Path]:
    """The wheels whose distribution is missing from ``installed`` (normalised name -> version) or
    installed older than its entry in ``minimums``; two wheels of one distribution are an error (pip
    would refuse them)."""
    chosen, seen = [], {}
    for path in sorted(wheels):
        name, version = wheel_distribution(path)
        if name in seen:
            raise ValueError(f"two wheels of {name} in {path.parent}: {seen[name].name} and {path.name}; keep one")
        seen[name] = path
        present = installed.get(name)
        if present is None or (name in minimums and version_key(present) < version_key(minimums[name])):
            chosen.append(path)
    return chosen


def installed_distributions() -> dict[str, str]:
    """Normalised name -> version of what imports: the first of a name on ``sys.path`` wins."""
    versions: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"]:
            versions.setdefault(normalise(dist.metadata["Name"]), dist.version)
    return versions


def checkout_installed() -> bool:
    """rlplat and the plugins the checks use import from this checkout already."""
    probe = ("import rlplat, rlplat_engine_fsdp2, rlplat_rollout_hf, tensordict, omegaconf, sys; "
             "print(rlplat.__file__)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd="/")
    return result.returncode == 0 and Path(result.stdout.strip()).resolve().is_relative_to(REPO)


def install(wheels_dir: Path, log) -> dict[str, Any]:
    """Install the missing wheels, then this checkout; a report line."""
    started = time.time()
    if checkout_installed():
        return {**line("install", "install", True, "rlplat and its plugins already import from this checkout"),
                "seconds": round(time.time() - started, 1)}
    wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
    if not wheels:
        return failure_line("install", "error", f"no wheels in {wheels_dir}: run `make gpu-check-wheels` where pip can download, "
                            "and bring that folder with the checkout")
    chosen = wheels_to_install(wheels, installed_distributions())
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--disable-pip-version-check"]
    steps = []
    if chosen:
        steps.append(pip + [str(path) for path in chosen])
    packages = checkout_packages()
    editable = [argument for folder in packages for argument in ("-e", str(folder))]
    steps.append(pip + ["--no-build-isolation"] + editable)
    for command in steps:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        if result.returncode:
            return failure_line("install", "error", f"pip exited {result.returncode} (see {LOG_FILE})", time.time() - started)
    if not checkout_installed():
        return failure_line("install", "error", f"installed, but rlplat does not import from {REPO} (see {LOG_FILE})",
                            time.time() - started)
    names = ", ".join(wheel_distribution(path)[0] for path in chosen) or "none"
    return {**line("install", "install", True, f"from {wheels_dir.name}: {names}; rlplat + {len(packages) - 1} plugins editable",
                   wheels=[path.name for path in chosen]), "seconds": round(time.time() - started, 1)}


# -- running the checks ------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    facts: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    for name in ("torch", "transformers", "ray", "tensordict", "omegaconf", "peft", "rlplat"):
        try:
            facts[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts[name] = None
    try:
        import torch

        facts["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
            version = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as error:  # the report keeps what it could read
        facts["torch_error"] = f"{type(error).__name__}: {error}"
    return facts


def child_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def run_check(check: Check, work: Path, log, timeout_s: float, smoke: bool) -> list[dict[str, Any]]:
    """Run one check in a process of its own; its lines, or one line saying why there are none."""
    result_file = work / f"{check.name}.result.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", check.name, "--result-file", str(result_file),
               "--work", str(work)] + (["--cpu-smoke"] if smoke else [])
    log.write(f"\n===== {check.name}: {check.description}\n")
    log.flush()
    started = time.time()
    # A process group of its own, so that a check stopped at its limit takes the processes it started
    # (a training run, pytest) with it instead of leaving them on the GPU for the next check.
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=child_environment(),
                             start_new_session=True)
    try:
        returncode = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(child)
        return [failure_line(check.name, "timeout", f"stopped after {timeout_s:.0f} s (see {LOG_FILE})", time.time() - started)]
    finally:
        stop_group(child)  # what the check left running
    seconds = time.time() - started
    if not result_file.exists():
        return [failure_line(check.name, "error", f"exited {returncode} without a result (see {LOG_FILE})", seconds)]
    lines = json.loads(result_file.read_text())
    result_file.unlink()
    for record in lines:
        record["seconds"] = round(record.pop("seconds", seconds / len(lines)), 1)
    return lines


def stop_group(child: subprocess.Popen) -> None:
    """Kill every process of ``child``'s process group that still runs, and reap ``child``."""
    import signal

    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def run_child(name: str, result_file: Path, work: Path, smoke: bool) -> int:
    """Inside a check's own process: run it, write its lines (an exception becomes an ``error`` line)."""
    import traceback

    sys.path.insert(0, str(SCRIPTS))
    import gpu_check_cases

    started = time.time()
    try:
        context = gpu_check_cases.Context(device="cpu" if smoke else "cuda", work=work, smoke=smoke)
        lines = gpu_check_cases.CASES[name](context)
    except Exception as error:
        traceback.print_exc()
        lines = [failure_line(name, "error", f"{type(error).__name__}: {error}"[:400], time.time() - started)]
    result_file.write_text(json.dumps(lines, default=str))
    return 0


def select(only: str | None) -> list[Check]:
    if not only:
        return list(CHECKS)
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in CHECK_NAMES]
    if unknown:
        raise SystemExit(f"gpu-check: unknown check(s) {unknown}; the checks are {', '.join(CHECK_NAMES)}")
    return [check for check in CHECKS if check.name in wanted]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="folder of the report and the log")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "gpu-check-work", help="folder of what the checks write besides")
    parser.add_argument("--wheels", type=Path, default=REPO / ".gpu-wheels", help="the wheels `make gpu-check-wheels` downloaded")
    parser.add_argument("--only", help=f"comma-separated checks to run (of {', '.join(CHECK_NAMES)})")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for all checks together, install included")
    parser.add_argument("--no-install", action="store_true", help="use what is installed; install nothing")
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: tests this script, not the GPU path")
    parser.add_argument("--child", choices=CHECK_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args.child, args.result_file, args.work, args.cpu_smoke)
    checks = select(args.only)
    if not args.cpu_smoke:
        problem = gpu_problem()
        if problem:
            print(f"gpu-check: refused: {problem}; it runs on a machine with a CUDA GPU (nothing was installed or run)", file=sys.stderr)
            return 2
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = []
    with open(args.out / LOG_FILE, "w") as log:
        if not (args.no_install or args.cpu_smoke):
            print("gpu-check: installing ...", flush=True)
            try:
                lines.append(install(args.wheels.resolve(), log))
            except (OSError, ValueError) as error:  # an unreadable or ambiguous wheel folder
                lines.append(failure_line("install", "error", str(error)))
            print(f"  {lines[-1]['status']}: {lines[-1]['figure']}", flush=True)
        env = environment()
        if lines and lines[0]["status"] != "pass":
            lines += [failure_line(check.name, "not run", "the install failed") for check in checks]
            checks = []
        for check in checks:
            left = args.budget_s - (time.time() - started)
            if left < check.minimum_s:
                lines.append(failure_line(check.name, "not run", f"{left:.0f} s of the {args.budget_s:.0f} s budget left, it needs "
                                          f"{check.minimum_s:.0f} s"))
                continue
            print(f"gpu-check: {check.name} ...", flush=True)
            produced = run_check(check, args.work, log, min(check.timeout_s, left), args.cpu_smoke)
            for record in produced:
                print(f"  {record['status']}: {record['name']}: {record['figure']}", flush=True)
            lines += produced
    report = write_report(args.out / REPORT_FILE, lines, env, started, time.time())
    print()
    print(summary_table(lines))
    print(f"gpu-check: report {args.out / REPORT_FILE}, log {args.out / LOG_FILE} ({report['wall_s']:.0f} s)")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
