"""Make PyPI's torchvision importable beside a CPU build of torch, in the environment whose Python runs this
(``make`` runs it in ``.venv-sglang-cpu``, after installing SGLang).

SGLang imports ``torchvision.transforms`` at module level. PyPI's torchvision is a CUDA build: its C++ operators
do not load with a CPU torch, which torchvision handles (``torchvision.extension._has_ops()`` is False and every
operator's fake kernel is registered only when it is True), except for two: the fake kernels of ``nms`` and
``qnms`` are registered unconditionally, and registering one for an operator that does not exist raises
(``RuntimeError: operator torchvision::nms does not exist``), so ``import torchvision`` fails. This script guards
those two registrations like the others, in the installed ``torchvision/_meta_registrations.py``. Text models
never call torchvision's operators; calling one still fails, with torchvision's own "Couldn't load custom C++
ops" error.

It changes nothing when the guard is already there (it may run again), and refuses, changing nothing, a
torchvision whose file does not hold the two registrations as expected. Exit status 0: torchvision imports.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

UNGUARDED = '@torch.library.register_fake("torchvision::{name}")\n'
GUARDED = '@(torch.library.register_fake("torchvision::{name}") if torchvision.extension._has_ops() else (lambda fn: fn))\n'
OPERATORS = ("nms", "qnms")


def guarded(text: str) -> str:
    """``text`` (the file) with both registrations guarded; ValueError when either is not there exactly once."""
    for name in OPERATORS:
        unguarded, guard = UNGUARDED.format(name=name), GUARDED.format(name=name)
        if text.count(guard) == 1 and unguarded not in text:
            continue
        if text.count(unguarded) != 1:
            raise ValueError(f"the registration of torchvision::{name} is not the one this script knows ({unguarded.strip()!r})")
        text = text.replace(unguarded, guard)
    return text


def imports() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import torchvision.transforms"], capture_output=True, text=True)


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("close_torchvision_gap: torchvision is not installed in this environment: nothing to do")
        return 0
    path = Path(spec.origin).parent / "_meta_registrations.py"
    if imports().returncode == 0:
        print(f"close_torchvision_gap: torchvision imports already ({path.parent})")
        return 0
    try:
        text = guarded(path.read_text())
    except (OSError, ValueError) as error:
        print(f"close_torchvision_gap: {path}: {error}; left unchanged", file=sys.stderr)
        return 1
    path.write_text(text)
    result = imports()
    if result.returncode != 0:
        print(f"close_torchvision_gap: guarded {path}, but `import torchvision.transforms` still fails:\n{result.stderr}", file=sys.stderr)
        return 1
    print(f"close_torchvision_gap: guarded the nms and qnms fake kernels in {path}; torchvision imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
