"""The fsdp2 actor update's throughput on one CUDA GPU, case by case: tokens/s, MFU against the measured and the
datasheet peak, kernel-busy share and the top operators of a profiled step.

The measurement is the GPU check's (``scripts/gpu_check_cases.py``: ``measure_update``, the same random-init Qwen2
shapes, the SFT loss on random full rows, two warm-up steps then the median of the timed ones, one more profiled);
this script runs one case with the settings given, to compare them one at a time on a lent machine:

    python3 bench/gpu_throughput.py --case 0.5b [--compile] [--packed-attention grouped] [--no-fused-head]

Cases: ``0.5b`` (Qwen2.5-0.5B shape, 16 x 2048, 8 rows a micro-batch), ``1.5b`` (Qwen2-1.5B, 16 x 2048, 4 rows),
``0.5b-4k`` (8 x 4096, 4 rows), ``0.5b-8k`` (4 x 8192, 2 rows). Without a CUDA device it refuses in one line (exit 2);
``--smoke`` runs the same code at toy sizes on the CPU (it tests the script: its figures mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

CASES = {
    "0.5b": ("QWEN2_05B", 16, 1024, 8),
    "1.5b": ("QWEN2_15B", 16, 1024, 4),
    "0.5b-4k": ("QWEN2_05B", 8, 2048, 4),
    "0.5b-8k": ("QWEN2_05B", 4, 4096, 2),
}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="0.5b")
    parser.add_argument("--compile", action="store_true", help="actor.engine_config.compile=true")
    parser.add_argument("--packed-attention", default="auto", help="actor.engine_config.packed_attention (auto, grouped, varlen, flex)")
    parser.add_argument("--no-fused-head", action="store_true", help="actor.engine_config.fused_head=false")
    parser.add_argument("--timed", type=int, default=4, help="timed steps after two warm-up ones")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: tests the script, not the GPU")
    return parser.parse_args()


def main() -> int:
    args = parse_arguments()
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU, or --smoke")
        return 2
    import gpu_check_cases as cases

    context = cases.Context(device="cpu" if args.smoke else "cuda", work=Path("."), smoke=args.smoke)
    shape_name, rows, half, micro = CASES[args.case]
    options = {"packed_attention": args.packed_attention}
    if args.compile:
        options["compile"] = True
    if args.no_fused_head:
        options["fused_head"] = False
    peak = cases.matmul_peak(context.size(8192, 256))
    datasheet = cases.datasheet_peak()
    figures = cases.measure_update(context, context.model(getattr(cases, shape_name)), rows=context.size(rows, 2),
                                   prompt_length=context.size(half, 16), response_length=context.size(half, 16),
                                   micro_rows=context.size(micro, 1), profile=True, timed=args.timed, **options)
    print(f"case {args.case}, settings {options}")
    print(cases.mfu_figure(figures, peak, datasheet, context))
    busy = figures["profile"].get("busy")
    if busy is not None:
        print(f"kernels busy {busy:.0%} of a profiled step")
    print(f"first losses {', '.join(f'{loss:.5f}' for loss in figures['losses'][:3])}; built in {figures['build_s']:.0f} s, "
          f"warm-up {figures['warm_s']:.0f} s")
    print(cases.FLOP_CONVENTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
