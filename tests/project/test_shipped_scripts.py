"""Every script, example and benchmark the project ships still imports what it names, loads, and answers
``--help``: a module that moves or is renamed breaks them here, not on the one machine (a GPU, the
benchmark environment) where they run.

Three checks: every import of a first-party module (``rlplat``, its plugins, the scripts' own sibling
modules) anywhere in a file, functions included, resolves to a module and the names it takes exist (the
Python embedded in shell scripts too); every file loads as a module in a fresh interpreter (its top-level
code runs, its ``__main__`` block does not); every command-line script answers ``--help``. The benchmarks'
baselines (trl, verl) live in the benchmark environment only (``make bench``): a file that needs them is
loaded there, and here must fail on nothing else.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("scripts", "examples", "bench")
BENCH_ONLY = {"trl", "verl"}  # installed by make bench into .venv-bench, not by make setup
FIRST_PARTY = re.compile(r"rlplat(_\w+)?$")
PYTHON_FILES = sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))
SHELL_FILES = sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.sh"))


def embedded_python(script: str) -> list[str]:
    """The Python a shell script runs: ``python ... <<'PY'`` here-documents and ``python -c "..."`` texts."""
    blocks = [match.group(2) for match in re.finditer(r"<<-?'?(PY|EOF)'?\n(.*?)\n\1\n", script, re.S)]
    blocks += [match.group(1) for match in re.finditer(r"python\"? -c \"(.*?)(?<!\\)\"", script, re.S)]
    return [block.replace("\\\"", "\"").replace("$", "_") for block in blocks]


def imports_in(source: str) -> list[tuple[int, int, str, list[str]]]:
    """``(line, level, module, names)`` of every import statement, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, 0, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.level, node.module or "", [alias.name for alias in node.names]))
    return found


def top_level_names(path: Path) -> set[str]:
    """What a module file defines at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:  # a name, or names unpacked (``A, B = 1, 2``)
                names.update(element.id for element in ast.walk(target) if isinstance(element, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def local_module(folder: Path, dotted: str) -> Path | None:
    """The file of module ``dotted`` found from ``folder`` (a sibling script or a package beside it)."""
    base = folder.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def problems_of_import(origin: Path, level: int, module: str, names: list[str]) -> list[str]:
    folder = origin.parent
    if level:  # a relative import inside a shipped package (the plugin template)
        for _ in range(level - 1):
            folder = folder.parent
        target = local_module(folder, module) if module else folder / "__init__.py"
        if target is None or not target.is_file():
            return [f"relative module {'.' * level}{module} not found"]
        missing = [name for name in names if name not in top_level_names(target) and local_module(target.parent, name) is None]
        return [f"{'.' * level}{module} has no {', '.join(missing)}"] if missing else []
    top = module.split(".")[0]
    sibling = local_module(origin.parent, module)
    if sibling is not None or (origin.parent / top).is_dir() or local_module(origin.parent, top):
        if sibling is None:
            return [f"{module} not found beside {origin.name}"]
        missing = [name for name in names if name != "*" and name not in top_level_names(sibling)
                   and local_module(sibling.parent, name) is None]
        return [f"{module} has no {', '.join(missing)}"] if missing else []
    if not FIRST_PARTY.match(top):
        return []  # third-party: the environment's business (and the load check below)
    if importlib.util.find_spec(top) is None:
        shipped = [path for path in ROOT.glob(f"examples/*/{top}/__init__.py")]
        if shipped:  # a shipped package that is not installed here (the plugin template)
            return problems_of_import(shipped[0].parent.parent / "x.py", 0, module, names)
        return [f"{module}: no installed distribution provides {top}"]
    try:
        imported = importlib.import_module(module)
    except ImportError as error:
        return [f"import {module}: {error}"]
    missing = [name for name in names if name != "*" and not hasattr(imported, name)
               and importlib.util.find_spec(f"{module}.{name}") is None]
    return [f"{module} has no {', '.join(missing)}"] if missing else []


@pytest.mark.parametrize("path", PYTHON_FILES + SHELL_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_first_party_import_resolves(path):
    text = path.read_text()
    sources = embedded_python(text) if path.suffix == ".sh" else [text]
    if path.suffix == ".sh":
        assert sources, f"{path.name}: no embedded Python found; has the script's shape changed?"
    problems = [f"{path.relative_to(ROOT)}:{line}: {problem}"
                for source in sources for line, level, module, names in imports_in(source)
                for problem in problems_of_import(path, level, module, names)]
    assert problems == []


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_shell_script_parses(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_embedded_python_of_a_shell_script_is_found():
    script = 'x=$(python -c "from rlplat import demo\nprint(demo.train_file())")\n"$VENV/bin/python" - <<\'PY\'\nimport rlplat.trainer.tracking\nPY\n'
    assert [imports_in(block) for block in embedded_python(script)] == [[(1, 0, "rlplat.trainer.tracking", [])],
                                                                        [(1, 0, "rlplat", ["demo"])]]


def test_a_missing_first_party_name_is_reported():
    origin = ROOT / "scripts" / "example.py"
    assert problems_of_import(origin, 0, "rlplat.contracts", ["no_such_name"]) == ["rlplat.contracts has no no_such_name"]
    assert problems_of_import(origin, 0, "rlplat.no_such_module", []) != []
    assert problems_of_import(origin, 0, "gpu_check", ["no_such_function"]) == ["gpu_check has no no_such_function"]


LOADER = r"""
import contextlib, io, json, runpy, sys, traceback


def outcome(path, run_name, argv):
    folder = path.rsplit("/", 1)[0]
    sys.path.insert(0, folder)
    sys.argv = argv
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            runpy.run_path(path, run_name=run_name)
        return None if run_name != "__main__" else ["error", "ran without stopping at --help"]
    except SystemExit as stop:
        if run_name == "__main__" and stop.code in (0, None) and "usage:" in output.getvalue():
            return None
        return ["error", f"exit {stop.code!r}: {output.getvalue()[-500:]}"]
    except ModuleNotFoundError as error:
        return ["missing", error.name or str(error)]
    except BaseException as error:
        return ["error", "".join(traceback.format_exception_only(type(error), error)).strip()]
    finally:
        sys.path.remove(folder)


modules, commands = json.loads(sys.argv[1])
results = {"load": {path: outcome(path, "rlplat_shipped_script_check", [path]) for path in modules},
           "help": {path: outcome(path, "__main__", [path, "--help"]) for path in commands}}
print("RESULTS " + json.dumps(results))
"""


def command_line_scripts() -> list[Path]:
    return [path for path in PYTHON_FILES if "plugin-template" not in path.parts
            and "argparse" in (text := path.read_text()) and '__name__ == "__main__"' in text]


@pytest.mark.slow
def test_every_shipped_file_loads_and_every_command_line_script_answers_help():
    # one interpreter for all of them (torch and rlplat imported once): each file runs as a module (its
    # top-level code, not its __main__ block), then each command-line script as __main__ with --help
    modules = [str(path) for path in PYTHON_FILES if "plugin-template" not in path.parts]  # a package: its own tests
    commands = [str(path) for path in command_line_scripts()]
    result = subprocess.run([sys.executable, "-c", LOADER, json.dumps([modules, commands])], capture_output=True,
                            text=True, cwd=ROOT, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-3000:]
    outcomes = json.loads(lines[-1][len("RESULTS "):])
    failures = {f"{check} {Path(path).relative_to(ROOT).as_posix()}": found for check, results in outcomes.items()
                for path, found in results.items()
                if found is not None and not (found[0] == "missing" and found[1].split(".")[0] in BENCH_ONLY)}
    assert failures == {}
    assert len(outcomes["help"]) == len(commands) >= 10


def test_the_reward_model_example_config_validates(monkeypatch):
    from rlplat.config import load_config

    monkeypatch.chdir(ROOT)  # its paths are relative to the repository root, as its header says
    config = load_config(ROOT / "examples" / "reward_model_grpo.yaml")
    assert config.reward.model.path and config.algorithm.name == "grpo"
