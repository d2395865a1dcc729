"""Measured matmul throughput beside what a profile assumes (the first GPU check's last part).

Run: python bench/matmul_efficiency.py [--device cuda|cpu] [--profiles dgx-a100 dgx-h100]
     [--repeats 20]

For a few square and transformer-like shapes, each dtype the device runs fast (CUDA: fp32,
bf16, fp16; CPU: fp32), the median of `repeats` timed matmuls (CUDA: synchronized before reading
the clock) as TFLOP/s (2 m n k flops per matmul), and that rate as a share of each named
profile's peak beside the profile's assumed `efficiency.matmul` (the spec profiles' value is an
assumption, marked as such in the profile: this table is how it gets replaced by a measurement).
On a machine without CUDA it measures the CPU against the shipped `cpu-gloo` profile instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# As a script, bench/ comes first on the path, where bench/costmodel.py shadows the package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402 - after the path fix above

from costmodel.profile_io import load_profile  # noqa: E402

SHAPES = ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 12288), (2048, 12288, 4096))
CPU_SHAPES = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024))  # a few seconds on 2 cores
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_tflops(m: int, n: int, k: int, dtype: torch.dtype, device: str, repeats: int) -> float:
    """The median rate of `repeats` (m x k) @ (k x n) matmuls after 3 warm-up ones."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for index in range(repeats + 3):
        sync()
        start = time.perf_counter()
        torch.matmul(a, b)
        sync()
        if index >= 3:
            times.append(time.perf_counter() - start)
    return 2 * m * n * k / statistics.median(times) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", choices=("cuda", "cpu"))
    parser.add_argument(
        "--profiles", nargs="+", default=["dgx-a100", "dgx-h100"] if cuda else ["cpu-gloo"]
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    profiles = [load_profile(name) for name in args.profiles]
    on_gpu = args.device == "cuda"
    if not on_gpu:
        torch.set_num_threads(1)  # cpu-gloo prices a rank with one thread (its device name says)
    shapes = SHAPES if on_gpu else CPU_SHAPES
    dtypes = DTYPES if on_gpu else {"fp32": torch.float32}
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"matmul throughput on {name} ({args.repeats} repeats, median)")
    for label, dtype in dtypes.items():
        for m, n, k in shapes:
            rate = measure_tflops(m, n, k, dtype, args.device, args.repeats)
            shares = []
            for p in profiles:
                peak = getattr(p.device.peak_flops, label).value
                peak_tflops = (
                    peak / 1e3 if "GFLOP" in getattr(p.device.peak_flops, label).unit else peak
                )
                shares.append(
                    f"{p.name}: {rate / peak_tflops:.2f} of peak {peak_tflops:g} "
                    f"(assumed {p.efficiency.matmul.value:.2f})"
                )
            print(f"{label} {m}x{k} @ {k}x{n}: {rate:.3f} TFLOP/s; " + "; ".join(shares))


if __name__ == "__main__":
    main()
