"""The two gaps of SGLang's CPU engine on PyPI that the project closes (plugins/rollout/sglang/cpu): the
``sgl_kernel`` functions a text model calls, in plain torch, against what SGLang's own kernels do; and PyPI's
torchvision made importable beside a CPU torch. Run where they are installed (``.venv-sglang-cpu``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sgl_kernel") is None:
    pytest.skip("sgl_kernel is not installed here: `make test` runs these tests in .venv-sglang-cpu", allow_module_level=True)
try:
    importlib.metadata.distribution("rlplat-sgl-kernel-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("the installed sgl_kernel is SGLang's own, not the project's CPU stand-in", allow_module_level=True)

import sgl_kernel  # noqa: E402

GAP_SCRIPT = Path(__file__).parents[1] / "cpu" / "close_torchvision_gap.py"


def test_the_batchs_slots_go_into_each_requests_row_of_the_table():
    """Three requests in table rows 4, 0 and 2: 3 new slots for the first (positions 2..4), 1 for the second
    (position 5), none for the third; the slots lie one after another in out_cache_loc, in batch order."""
    table = torch.full((6, 8), -1, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([4, 0, 2]), table, torch.tensor([2, 5, 3]), torch.tensor([5, 6, 3]), torch.tensor([70, 71, 72, 73, 99]), 8)
    expected = torch.full((6, 8), -1, dtype=torch.int32)
    expected[4, 2:5] = torch.tensor([70, 71, 72], dtype=torch.int32)
    expected[0, 5] = 73
    assert torch.equal(table, expected)


def test_a_batch_needing_more_slots_than_it_got_is_refused():
    with pytest.raises(ValueError, match="need 4 slots but out_cache_loc has 3"):
        sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([0]), torch.zeros(1, 8, dtype=torch.int32), torch.tensor([0]),
                                                torch.tensor([4]), torch.tensor([1, 2, 3]), 8)


def test_kv_rows_are_copied_in_every_layers_buffer_reading_all_sources_first():
    """Two buffers (float32 rows of 4, bfloat16 rows of 6): row 3 takes row 1 and row 1 takes row 3 (a swap),
    row 0 takes row 2; the other rows are untouched."""
    buffers = [torch.arange(20, dtype=torch.float32).reshape(5, 4), torch.arange(30, dtype=torch.bfloat16).reshape(5, 6)]
    before = [buffer.clone() for buffer in buffers]
    sgl_kernel.copy_all_layer_kv_cache_cpu(
        torch.tensor([buffer.data_ptr() for buffer in buffers], dtype=torch.uint64),
        torch.tensor([buffer.stride(0) * buffer.element_size() for buffer in buffers]),
        torch.tensor([3, 1, 0]), torch.tensor([1, 3, 2]))
    for buffer, old in zip(buffers, before):
        assert torch.equal(buffer[[3, 1, 0]], old[[1, 3, 2]]) and torch.equal(buffer[[2, 4]], old[[2, 4]])


def test_what_is_not_provided_raises_with_its_name():
    with pytest.raises(RuntimeError, match="sgl_kernel.verify_tree_greedy_cpu is not available.*speculative decoding"):
        sgl_kernel.verify_tree_greedy_cpu()
    from sgl_kernel.mamba import causal_conv1d_fn_cpu

    with pytest.raises(RuntimeError, match="mamba.causal_conv1d_fn_cpu is not available"):
        causal_conv1d_fn_cpu()


def test_no_sgl_kernel_operator_is_registered():
    """SGLang takes ``torch.ops.sgl_kernel.convert_weight_packed`` to mean an Intel AMX build: it must not exist."""
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


def test_torchvision_imports_beside_the_cpu_torch_and_its_operators_say_they_did_not_load():
    import torchvision.ops
    import torchvision.transforms  # noqa: F401  (SGLang imports it at module level)

    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):
        torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)


def test_the_torchvision_script_may_run_again_and_refuses_a_file_it_does_not_know(tmp_path):
    result = subprocess.run([sys.executable, str(GAP_SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0 and "imports already" in result.stdout
    sys.path.insert(0, str(GAP_SCRIPT.parent))
    try:
        from close_torchvision_gap import guarded
    finally:
        sys.path.remove(str(GAP_SCRIPT.parent))
    text = '@torch.library.register_fake("torchvision::nms")\ndef a(): pass\n@torch.library.register_fake("torchvision::qnms")\n'
    once = guarded(text)
    assert guarded(once) == once and "_has_ops() else (lambda fn: fn))" in once
    with pytest.raises(ValueError, match="registration of torchvision::qnms is not the one this script knows"):
        guarded(text.replace("qnms", "other"))


def test_rlplat_doctor_finds_no_known_bad_combination_in_this_environment():
    """sglang beside the CPU torch, without its CUDA dependencies, is what this environment is: doctor says so in a
    note and reports no error."""
    from rlplat.cli import doctor

    problems = doctor.diagnose(doctor.installed_versions())
    assert not [problem.message for problem in problems if problem.severity == "error"]
    assert any("installs sglang without its CUDA dependency list" in problem.message for problem in problems)
