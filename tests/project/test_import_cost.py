"""``import rlplat`` and plugin listing stay free of torch, Ray and tensordict."""

HEAVY = ("torch", "ray", "tensordict", "transformers", "vllm", "sglang", "megatron")


def test_import_rlplat_and_listing_entries_import_nothing_heavy(python_run):
    result = python_run(f"""
        import sys
        import rlplat
        from rlplat import registry, hookimpl, EngineRegistry, TrainingEngine, RolloutEngine, RewardManager, Algorithm
        for kind in ("engine", "rollout", "reward_scorer", "algorithm"):
            for name in registry.names(kind):
                registry.entry(kind, name).status
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_rlplat_plugins_list_imports_nothing_heavy(python_run):
    result = python_run(f"""
        import sys
        from rlplat.cli.main import main
        try:
            main(["plugins", "list"])
        except SystemExit as exit:
            assert not exit.code, exit.code
        print("HEAVY", sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "HEAVY []"
