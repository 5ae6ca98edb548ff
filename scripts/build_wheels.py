#!/usr/bin/env python3
"""Build the wheels of rlplat and its plugin distributions from this checkout (``make dist``).

    python scripts/build_wheels.py OUT_DIR PROJECT_DIR...

Each project (a folder with a ``pyproject.toml``; ``.`` is core) is built from a copy of the working tree as
git sees it (tracked files and untracked ones git does not ignore), so a stale ``build/`` or ``*.egg-info``
of the checkout never leaks into a wheel and the checkout is left as it was. The build uses this
interpreter's setuptools without build isolation (``pip wheel --no-deps --no-build-isolation``): no network,
no fresh build environment per project. ``SOURCE_DATE_EPOCH`` is the last commit's time unless set, so two
builds of the same tree give byte-identical wheels.

Every wheel is checked before it is kept: each file of the working tree inside one of its packages' folders
(modules, and package data such as the demo's assets or the agent templates) must be in it; a file left
out fails the build with its name. ``OUT_DIR`` is emptied of wheels first, then holds one per project.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path, PurePosixPath


def repository_root() -> Path:
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent)
    if top.returncode != 0:
        sys.exit(f"build_wheels: {Path(__file__).parent} is not in a git checkout; the wheels are built from "
                 f"the files git knows about ({top.stderr.strip()})")
    return Path(top.stdout.strip())


def working_tree_files(root: Path) -> list[PurePosixPath]:
    """The files git sees in the working tree: tracked (and not deleted) plus untracked, not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True, cwd=root).stdout.decode()
    names = sorted({name for name in listed.split("\0") if name})
    return [PurePosixPath(name) for name in names if (root / name).is_file()]


def copy_working_tree(root: Path, files: list[PurePosixPath], destination: Path) -> None:
    for name in files:
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)


def source_folder(package: str, package_dir: dict[str, str]) -> PurePosixPath:
    """Where setuptools reads ``package`` from, relative to the project (``[tool.setuptools] package-dir``)."""
    parts = package.split(".")
    for length in range(len(parts), -1, -1):
        prefix = ".".join(parts[:length])
        if prefix in package_dir:
            return PurePosixPath(package_dir[prefix], *parts[length:])
    return PurePosixPath(*parts)


def files_missing_from_wheel(wheel: Path, project: PurePosixPath, files: list[PurePosixPath],
                             package_dir: dict[str, str]) -> list[str]:
    """Working-tree files inside a folder of a package the wheel ships that the wheel does not contain.

    A file belongs to the deepest package folder that holds it, so data in a subfolder without
    ``__init__.py`` (``rlplat/demo/assets/...``) is expected under that package in the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
    packages = {str(PurePosixPath(name).parent).replace("/", ".")
                for name in members if PurePosixPath(name).name == "__init__.py"}
    folders = {project / source_folder(package, package_dir): PurePosixPath(*package.split("."))
               for package in packages}
    missing = []
    for name in files:
        holders = [folder for folder in folders if folder in name.parents]
        if not holders or "__pycache__" in name.parts:
            continue
        folder = max(holders, key=lambda held: len(held.parts))
        in_wheel = str(folders[folder] / name.relative_to(folder))
        if in_wheel not in members:
            missing.append(f"{name} (expected as {in_wheel})")
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the wheels (emptied of *.whl first)")
    parser.add_argument("projects", nargs="+", help="project folders relative to the repository root ('.' is core)")
    args = parser.parse_args(argv)

    root = repository_root()
    out = args.out.resolve()
    files = working_tree_files(root)
    projects = [PurePosixPath(Path(project).resolve().relative_to(root).as_posix()) for project in args.projects]
    for project in projects:
        if project / "pyproject.toml" not in files:
            sys.exit(f"build_wheels: {project}/pyproject.toml is not in the working tree")
    environment = dict(os.environ)
    if "SOURCE_DATE_EPOCH" not in environment:
        environment["SOURCE_DATE_EPOCH"] = subprocess.run(
            ["git", "log", "-1", "--format=%ct"], capture_output=True, text=True, check=True, cwd=root).stdout.strip()

    with tempfile.TemporaryDirectory(prefix="rlplat-dist-") as work:
        tree, built = Path(work) / "tree", Path(work) / "wheels"
        copy_working_tree(root, files, tree)
        # One pip for every project: ~1 s of start-up instead of one per project. Its output is shown only
        # when it fails: setuptools warns about every data folder of package-data (demo/assets/...) as a
        # package "absent from the packages configuration", and the check below is what says the files are in.
        build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                                "--no-cache-dir", "--wheel-dir", str(built), *(str(tree / project) for project in projects)],
                               capture_output=True, text=True, env=environment, cwd=tree)
        if build.returncode != 0:
            sys.exit(f"build_wheels: pip wheel failed (exit code {build.returncode}):\n{build.stdout}{build.stderr}")
        wheels = sorted(built.glob("*.whl"))
        if len(wheels) != len(projects):
            sys.exit(f"build_wheels: {len(projects)} projects gave {len(wheels)} wheels: {[w.name for w in wheels]}")
        problems = []
        for project in projects:
            config = tomllib.loads((tree / project / "pyproject.toml").read_text())
            wheel_name = re.sub(r"[-_.]+", "_", config["project"]["name"]).lower()
            wheel = next(w for w in wheels if w.name.split("-")[0] == wheel_name)
            package_dir = config.get("tool", {}).get("setuptools", {}).get("package-dir", {})
            for missing in files_missing_from_wheel(wheel, project, files, package_dir):
                problems.append(f"{wheel.name} lacks {missing}")
        if problems:
            sys.exit("build_wheels: files of the packages are missing from their wheels (add them to "
                     "[tool.setuptools.package-data] or to packages):\n  " + "\n  ".join(problems))
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.whl"):
            old.unlink()
        for wheel in wheels:
            shutil.copy2(wheel, out / wheel.name)
            print(f"{wheel.stat().st_size / 1024:9.1f} KiB  {out / wheel.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
