"""Shipping the user's code to Ray workers: ``start_ray(py_modules=..., runtime_env=...)``, the default
shipping of the driver's own modules, the ``cluster.*`` keys checked at load, and a loss built in the
driver reaching ``update_actor`` on 2 Ray workers from ``__main__``, from a module next to the script and
from a module in a folder of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Iterator

import pytest

from rlplat.config import ConfigError, load_config
from rlplat.controller.ray_backend import (
    DRIVER_PACKAGE_MAX_BYTES,
    driver_code_folder,
    driver_modules,
    resolve_py_module,
    worker_runtime_env,
)
from rlplat.kits.data import write_parquet


@pytest.fixture
def library(tmp_path, monkeypatch) -> Iterator[Path]:
    """A folder on ``sys.path`` holding ``user_losses.py`` and the package ``user_package``."""
    folder = tmp_path / "library"
    (folder / "user_package" / "losses").mkdir(parents=True)
    (folder / "user_losses.py").write_text("VALUE = 1\n")
    (folder / "user_package" / "__init__.py").write_text("")
    (folder / "user_package" / "losses" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in [name for name in sys.modules if name.partition(".")[0] in ("user_losses", "user_package")]:
        del sys.modules[name]


# -- resolving py_modules entries ---------------------------------------------------------------------


def test_an_import_name_ships_its_file_and_a_package_name_its_folder(library):
    assert resolve_py_module("user_losses") == str(library / "user_losses.py")
    assert resolve_py_module("user_package") == str(library / "user_package")


def test_a_dotted_name_ships_its_whole_top_level_package(library):
    assert resolve_py_module("user_package.losses") == str(library / "user_package")


def test_a_module_object_ships_the_file_it_was_imported_from(library):
    import user_losses

    assert resolve_py_module(user_losses) == str(library / "user_losses.py")


def test_paths_and_uris_are_taken_as_they_are(library):
    assert resolve_py_module(str(library / "user_package")) == str(library / "user_package")
    assert resolve_py_module(library / "user_losses.py") == str(library / "user_losses.py")
    assert resolve_py_module("s3://bucket/code.zip") == "s3://bucket/code.zip"


@pytest.mark.parametrize(
    "entry, message",
    [
        ("user_lossez", "no module named 'user_lossez' can be imported here"),
        ("/no/such/folder", "'/no/such/folder' is neither a folder nor a .py file"),
        ("sys", "module 'sys' is not Python source (built-in)"),
    ],
)
def test_an_entry_that_cannot_be_shipped_is_named_with_the_reason(library, entry, message):
    with pytest.raises(ValueError, match="^py_modules\\[1\\]: " + message.replace("(", "\\(").replace(")", "\\)")):
        worker_runtime_env(["user_losses", entry])


def test_the_main_script_needs_no_shipping():
    with pytest.raises(ValueError, match="cloudpickle sends its classes and functions by value"):
        resolve_py_module(types.ModuleType("__main__"))


def test_the_runtime_env_keeps_its_own_modules_first_and_turns_env_vars_into_strings(library):
    environment = worker_runtime_env(["user_losses", "user_losses"], {"py_modules": ["s3://bucket/a.zip"], "env_vars": {"THREADS": 4}})
    assert environment == {"py_modules": ["s3://bucket/a.zip", str(library / "user_losses.py")], "env_vars": {"THREADS": "4"}}


def test_a_misspelled_runtime_env_setting_is_named_with_the_closest_one():
    with pytest.raises(ValueError, match="runtime_env.envvars: not a setting of Ray's runtime environment. Did you mean 'env_vars'"):
        worker_runtime_env([], {"envvars": {"A": "1"}})


# -- the driver's own modules ------------------------------------------------------------------------


def fake_module(name: str, file: Path | None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = None if file is None else str(file)
    return module


def test_the_driver_ships_what_it_imported_from_its_own_folder_and_nothing_installed(tmp_path):
    folder = tmp_path / "project"
    (folder / "helpers").mkdir(parents=True)
    (folder / "numpy").mkdir()
    for file in ("train.py", "sibling.py", "not_imported.py", "helpers/__init__.py", "numpy/__init__.py"):
        (folder / file).write_text("")
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text("")
    modules = {
        "__main__": fake_module("__main__", folder / "train.py"),  # travels by value
        "sibling": fake_module("sibling", folder / "sibling.py"),
        "helpers": fake_module("helpers", folder / "helpers" / "__init__.py"),
        "helpers.inner": fake_module("helpers.inner", folder / "helpers" / "inner.py"),  # comes with helpers
        "numpy": fake_module("numpy", folder / "numpy" / "__init__.py"),  # an installed distribution's name
        "elsewhere": fake_module("elsewhere", elsewhere),  # not in the driver's folder
        "json": sys.modules["json"],  # the standard library
    }
    assert driver_modules(folder, modules) == [str(folder / "helpers"), str(folder / "sibling.py")]


def test_a_package_too_large_to_ship_by_default_is_left_out_with_a_warning(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "__init__.py").write_text("")
    with open(tmp_path / "checkpoints" / "weights.bin", "wb") as file:
        file.truncate(DRIVER_PACKAGE_MAX_BYTES + 1)  # sparse: no real disk use
    modules = {"checkpoints": fake_module("checkpoints", tmp_path / "checkpoints" / "__init__.py")}
    with pytest.warns(UserWarning, match="package 'checkpoints' .* is over 20 MiB and is not shipped.*cluster.py_modules"):
        assert driver_modules(tmp_path, modules) == []


def test_the_driver_folder_is_the_scripts_or_the_one_holding_the_package_run_with_dash_m(tmp_path, monkeypatch):
    assert driver_code_folder(fake_module("__main__", tmp_path / "train.py")) == tmp_path
    main = fake_module("__main__", tmp_path / "package" / "train.py")
    main.__spec__ = types.SimpleNamespace(name="package.train")
    assert driver_code_folder(main) == tmp_path
    monkeypatch.chdir(tmp_path)
    assert driver_code_folder(fake_module("__main__", None)) == tmp_path  # a notebook, python -c


def test_nothing_is_shipped_by_default_for_a_console_script_of_the_environment():
    main = fake_module("__main__", Path(sys.prefix) / "bin" / "rlplat")
    assert driver_code_folder(main) is None


# -- the cluster keys at load ------------------------------------------------------------------------


@pytest.fixture
def run_overrides(tmp_path) -> list[str]:
    model = tmp_path / "model"
    model.mkdir()
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}]
    train = write_parquet(rows, tmp_path / "train.parquet")
    return [f"model.path={model}", f"data.train_files=[{train}]", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4"]


def test_a_module_to_ship_that_cannot_be_found_is_a_config_error_naming_it(run_overrides):
    with pytest.raises(ConfigError, match=r"^cluster.py_modules\[0\]: no module named 'my_losess' can be imported here"):
        load_config(overrides=run_overrides + ["cluster.py_modules=[my_losess]"])


def test_a_misspelled_runtime_env_key_is_a_config_error(run_overrides):
    with pytest.raises(ConfigError, match=r"^cluster.runtime_env.envvars: .*Did you mean 'env_vars'"):
        load_config(overrides=run_overrides + ["cluster.runtime_env.envvars.OMP_NUM_THREADS=1"])


def test_the_shipping_keys_load_with_their_defaults_and_values(run_overrides, library):
    config = load_config(overrides=run_overrides + ["cluster.py_modules=[user_losses]", "cluster.runtime_env.env_vars.OMP_NUM_THREADS=1"])
    assert list(config.cluster.py_modules) == ["user_losses"] and config.cluster.ship_driver_modules is True
    assert worker_runtime_env(config.cluster.py_modules, config.cluster.runtime_env) == {
        "env_vars": {"OMP_NUM_THREADS": "1"}, "py_modules": [str(library / "user_losses.py")]}


# -- on Ray: a loss from __main__, from the script's folder and from a library folder ----------------

LOSS_SOURCE = '''
class {name}:
    """Token-mean negative log-likelihood of the responses, reported as {prefix}/nll."""

    needs_entropy = False

    def __call__(self, outputs, micro_batch):
        from rlplat.losses import aggregate_loss

        loss = aggregate_loss(-outputs["log_probs"], micro_batch.batch["response_mask"], "token-mean",
                              global_token_count=micro_batch.meta_info["global_token_count"])
        return loss, {{"{prefix}/nll": float(loss.detach())}}
'''

DRIVER = '''
import json, os, shutil, sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])  # the user's library folder, on the driver's sys.path only
import library_losses
import sibling_losses
import unshipped_losses

import ray
import torch

import rlplat_demo as demo
from rlplat import DataProto, RayWorkerGroup, ResourcePool, WorkerError, WorkerSpec, start_ray
from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker
{main_loss}

def batch_of(rows):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 16, (rows, 7), generator=generator)
    attention_mask = torch.ones(rows, 7, dtype=torch.long)
    for row in range(rows):
        attention_mask[row, 7 - row % 3 :] = 0
    return DataProto.from_dict({{"input_ids": input_ids * attention_mask, "attention_mask": attention_mask,
                                "position_ids": torch.arange(7).expand(rows, 7).clone(),
                                "responses": (input_ids * attention_mask)[:, 4:], "response_mask": attention_mask[:, 4:]}})


def nll(batch, actor):
    log_probs, mask = actor.compute_log_prob(batch).batch["old_log_probs"], batch.batch["response_mask"]
    return float(-(log_probs * mask).sum() / mask.sum())


start_ray(num_cpus=3, py_modules=["library_losses"], runtime_env={{"env_vars": {{"SHIP_TEST_VALUE": 42}}}})
script_folder = Path(__file__).resolve().parent
# From here on the script's folder is gone, as it is on another machine: what works came through Ray.
shutil.move(str(script_folder), str(script_folder) + "_moved")
results = {{"env": ray.get(ray.remote(lambda: os.environ.get("SHIP_TEST_VALUE")).remote())}}
config = {{"roles": ["actor"], "engine": "fsdp2", "algorithm": "grpo",
          "engine_config": {{"model_path": str(demo.model_dir()), "lr": 1e-3, "seed": 0, "micro_batch_size_per_gpu": 2}}}}
pool = ResourcePool([2])
actor = RayWorkerGroup(pool, WorkerSpec(ActorRolloutRefWorker, config), role="actor")
actor.init_model()
batch = batch_of(5)  # padded to 6 for 2 workers: the padding row has no weight
for loss in (MainLoss(), sibling_losses.SiblingLoss(), library_losses.LibraryLoss()):
    expected = nll(batch, actor)
    metrics = actor.update_actor(batch, loss_fn=loss).meta_info["metrics"]
    results[type(loss).__name__] = {{"expected": expected, "metrics": metrics, "after": nll(batch, actor)}}
try:
    actor.update_actor(batch, loss_fn=unshipped_losses.UnshippedLoss())
except WorkerError as error:
    results["unshipped"] = str(error)
start_ray(py_modules=["library_losses"])  # already shipped: nothing to do
try:
    start_ray(py_modules=["unshipped_losses"])
except RuntimeError as error:
    results["too_late"] = str(error)
actor.shutdown()
pool.release()
print("RESULT " + json.dumps(results))
'''


@pytest.mark.slow
def test_losses_from_main_the_scripts_folder_and_a_library_folder_train_on_two_ray_workers(tmp_path):
    driver, library_folder = tmp_path / "driver", tmp_path / "library"
    driver.mkdir()
    library_folder.mkdir()
    (driver / "sibling_losses.py").write_text(LOSS_SOURCE.format(name="SiblingLoss", prefix="sibling"))
    (library_folder / "library_losses.py").write_text(LOSS_SOURCE.format(name="LibraryLoss", prefix="library"))
    (library_folder / "unshipped_losses.py").write_text(LOSS_SOURCE.format(name="UnshippedLoss", prefix="unshipped"))
    script = driver / "train.py"
    script.write_text(textwrap.dedent(DRIVER.format(main_loss=LOSS_SOURCE.format(name="MainLoss", prefix="main"))))
    environment = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run([sys.executable, str(script), str(library_folder)], capture_output=True, text=True,
                            env=environment, cwd=tmp_path, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the driver failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    results = json.loads(lines[-1][len("RESULT "):])
    assert results["env"] == "42"
    for name, prefix in (("MainLoss", "main"), ("SiblingLoss", "sibling"), ("LibraryLoss", "library")):
        step = results[name]
        # The metric is the loss the workers computed with the shipped class: the NLL of the 5 real rows
        # under the weights before the step, as the driver measures it; the step then lowers it.
        assert step["metrics"][f"{prefix}/nll"] == pytest.approx([step["expected"]] * 2, rel=1e-5)  # as each rank reports it
        assert "actor/pg_loss" not in step["metrics"]
        assert step["after"] < step["expected"]
    assert "No module named 'unshipped_losses' (a module of yours that is not installed on the workers: ship it" in results["unshipped"]
    assert "Ray is already running in this process (started by start_ray without them)" in results["too_late"]
    assert "unshipped_losses.py" in results["too_late"]
