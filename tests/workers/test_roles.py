"""Worker roles (kind ``role``): a plugin adds a role that the loop builds, starts, calls at every stage
and checkpoints; the built-in roles go through the same path and can be placed in pools of their own."""

from __future__ import annotations

import pytest
import torch

from rlplat import DataProto, Worker, hookimpl, register
from rlplat.config import ConfigError, load_config
from rlplat.contracts.role import STAGES, Role, RoleConfig, RunContext
from rlplat.testing import RoleConformance
from rlplat.controller.decorator import Dispatch
from rlplat.controller.host import WorkerSpec
from rlplat.kits.data import write_parquet
from rlplat.testing.tiny_models import save_tiny_model
from rlplat.trainer.tracking import read_metrics
from rlplat.trainer import Trainer


class LengthWorker(Worker):
    """Counts the valid response tokens of each row it is given."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.started = False

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self):
        self.started = True

    @register(Dispatch.DP_COMPUTE_PROTO)
    def measure(self, batch):
        if not self.started:
            raise RuntimeError("measure() before init_model()")
        return DataProto.from_dict({"measured_length": batch.batch["response_mask"].sum(-1).float()})


class LengthRole(Role):
    """Adds ``measured_length`` after scoring, and records what the loop showed it."""

    def __init__(self):
        self.stages: list[str] = []
        self.seen_in_prepared: list[bool] = []
        self.saved: list[str] = []

    def enabled(self, run: RunContext) -> bool:
        return True

    def worker(self, run: RunContext) -> WorkerSpec:
        return WorkerSpec(LengthWorker, {"threshold": run.config.rollout.response_length})

    def on_stage(self, stage, group, batch):
        self.stages.append(stage)
        if stage == "scored":
            return group.measure(batch)
        if stage == "prepared":
            lengths = batch.batch["response_mask"].sum(-1).float()
            self.seen_in_prepared.append(torch.equal(batch.batch["measured_length"], lengths))
        return None

    def save_checkpoint(self, group, path):
        self.saved.append(path)


@pytest.fixture
def length_role(register_temporary_plugin):
    role = LengthRole()

    class Plugin:
        @hookimpl
        def register_roles(self, register):
            register("length", lambda: role, description="measures response lengths", config_schema=RoleConfig)

    register_temporary_plugin(Plugin(), name="length-role")
    return role


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}], "reward_model": {"ground_truth": str(a + b)}}
            for a, b in [(12, 34), (5, 6), (40, 2), (7, 7)]]
    return {"model": save_tiny_model(root / "model", seed=0), "train": write_parquet(rows, root / "train.parquet")}


def overrides(assets, output_dir, *extra):
    return [
        f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=3",
        "actor.micro_batch_size_per_gpu=4", f"trainer.output_dir={output_dir}", "trainer.logger=[jsonl]",
        "trainer.total_training_steps=2", "trainer.save_freq=2", *extra,
    ]


def test_a_plugin_role_is_built_started_called_at_every_stage_and_checkpointed(assets, tmp_path, length_role):
    config = load_config(overrides=overrides(assets, tmp_path / "run", "cluster.backend=local"), algo="grpo")
    trainer = Trainer(config)
    try:
        trainer.fit()
        assert set(trainer.placement.groups) == {"actor", "length"}
    finally:
        trainer.shutdown()
    assert length_role.stages == list(STAGES) * 2
    assert length_role.seen_in_prepared == [True, True]
    assert len(length_role.saved) == 1 and "global_step_2" in length_role.saved[0]


def test_a_plugin_roles_node_is_checked_with_its_schema(assets, tmp_path, length_role):
    with pytest.raises(ConfigError, match=r"unknown config key 'roles.length.placment'. Did you mean 'roles.length.placement'"):
        load_config(overrides=overrides(assets, tmp_path, "roles.length.placment=separate"))
    with pytest.raises(ConfigError, match="roles.length.placement=separate needs cluster.backend=ray"):
        load_config(overrides=overrides(assets, tmp_path, "cluster.backend=local", "roles.length.placement=separate"))


def test_the_actor_role_cannot_move_and_unknown_roles_are_named(assets, tmp_path):
    with pytest.raises(ConfigError, match="roles.actor.placement: the actor role always runs colocated"):
        load_config(overrides=overrides(assets, tmp_path, "roles.actor.placement=separate"))
    with pytest.raises(ConfigError, match=r"unknown role 'critc'.*Did you mean 'roles.critic'"):
        load_config(overrides=overrides(assets, tmp_path, "roles.critc.placement=separate"))


def test_a_separate_role_splits_batches_over_its_own_process_count(assets, tmp_path):
    with pytest.raises(ConfigError, match="do not split over the 3 worker processes of the critic"):
        load_config(overrides=overrides(assets, tmp_path, "cluster.devices_per_node=2", "roles.critic.placement=separate",
                                        "roles.critic.devices_per_node=3"), algo="ppo")


@pytest.mark.slow
def test_ppo_with_the_critic_and_the_rollout_in_pools_of_their_own(assets, tmp_path, local_ray):
    run = tmp_path / "run"
    config = load_config(overrides=overrides(
        assets, run, "cluster.devices_per_node=2", "roles.critic.placement=separate", "roles.critic.devices_per_node=1",
        "roles.rollout.placement=separate", "roles.rollout.devices_per_node=1"), algo="ppo")
    trainer = Trainer(config)
    try:
        trainer.fit()
        groups = trainer.placement.groups
        assert {name: group.world_size for name, group in groups.items()} == {"actor": 2, "critic": 1, "rollout": 1}
        pids = {name: set(group.pids()) for name, group in groups.items()}
        assert not pids["actor"] & pids["critic"] and not pids["actor"] & pids["rollout"]
        assert len(trainer.placement.pools) == 3
    finally:
        trainer.shutdown()
    metrics = read_metrics(run)
    assert [row["step"] for row in metrics if "critic/vf_loss" in row] == [1, 2]
    # the rollout in its own pool samples with the actor's weights: its log-probs match the engine's
    assert all(row["rollout/log_prob_diff_max"] < 1e-4 for row in metrics if "rollout/log_prob_diff_max" in row)


class TestBuiltInRoles(RoleConformance):
    @pytest.fixture(params=["actor", "rollout", "critic"])
    def role(self, request):
        from rlplat import registry

        return registry.get("role", request.param)()


class TestPluginRole(RoleConformance):
    @pytest.fixture
    def role(self):
        return LengthRole()


def test_the_role_suite_fails_a_role_whose_worker_is_no_worker(pytester):
    pytester.makepyfile(test_suite='''
        import pytest
        from rlplat.contracts.role import Role
        from rlplat.controller.host import WorkerSpec
        from rlplat.testing import RoleConformance

        class Broken(Role):
            default_placement = "elsewhere"

            def enabled(self, run):
                return "yes"

            def worker(self, run):
                return WorkerSpec(dict)

        class TestBroken(RoleConformance):
            @pytest.fixture
            def role(self):
                return Broken()
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2, failed=3)
