"""The machine a benchmark runs on: CPU and memory, and its memory bandwidth and f32 matmul rate measured in
the same run, the yardsticks the measured speeds are compared against."""

from __future__ import annotations

import math
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np

__all__ = ["available_memory_bytes", "cpu_name", "machine_info", "measure_bandwidth", "measure_peak_flops",
           "package_version", "peak_rss_bytes", "total_memory_bytes", "usable_cpus"]


def total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(total_memory_bytes() * 0.75)


def cpu_name() -> str:
    try:
        if sys.platform == "darwin":
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def package_version(pkg: str) -> str | None:
    """The installed version of ``pkg``, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def machine_info() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_name(),
            "cpu_count": usable_cpus(), "memory_bytes": total_memory_bytes(), "python": platform.python_version(),
            "numpy": np.__version__, "lily": package_version("lily"), "mlx": package_version("mlx"),
            "mlx_lm": package_version("mlx-lm")}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS has no sched_getaffinity
        return max(1, os.cpu_count() or 1)


def measure_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5, method: str = "numpy") -> dict:
    """Memory bandwidth in GB/s, best of ``repeats``: as a copy ((bytes read + bytes written) / time,
    the usual figure) and as a read (bytes read / time: what a decode step does, streaming weights)."""
    if method == "mlx":
        import mlx.core as mx

        n = size_bytes // 4
        a = mx.ones((n,), dtype=mx.float32)
        mx.eval(a)
        best, best_read = math.inf, math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            b = a + 1.0
            mx.eval(b)
            best = min(best, time.perf_counter() - t0)
            del b
            t0 = time.perf_counter()
            mx.eval(mx.max(a))
            best_read = min(best_read, time.perf_counter() - t0)
        return {"memory_bandwidth_gbps": 2 * n * 4 / best / 1e9, "read_bandwidth_gbps": n * 4 / best_read / 1e9,
                "bandwidth_method": f"mlx GPU copy / max {size_bytes >> 20} MiB"}
    from concurrent.futures import ThreadPoolExecutor

    n = size_bytes // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    raw = src.view(np.uint8)
    threads = usable_cpus()
    parts = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]

    def copy(p):
        np.copyto(dst[p[0]:p[1]], src[p[0]:p[1]])

    def read(p):  # a SIMD max over bytes: nothing but the stream of loads (numpy releases the GIL)
        return raw[8 * p[0]:8 * p[1]].max()

    def best_of(f) -> float:
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(f, parts))
            best = min(best, time.perf_counter() - t0)
        return best

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, parts))  # first touch
        t_copy, t_read = best_of(copy), best_of(read)
    return {"memory_bandwidth_gbps": 2 * n * 8 / t_copy / 1e9, "read_bandwidth_gbps": n * 8 / t_read / 1e9,
            "bandwidth_method": f"numpy copy / byte max {size_bytes >> 20} MiB, {threads} threads"}


def measure_peak_flops(method: str = "numpy", repeats: int = 5, n: int = 2048) -> dict:
    """The machine's f32 matmul rate in GFLOP/s (2 n^3 FLOPs per n x n product), best of ``repeats`` after a
    warm-up: numpy's BLAS with its own threads, or (method "mlx") an MLX matmul on its default device."""
    if method == "mlx":
        import mlx.core as mx

        a = mx.random.normal((n, n), dtype=mx.float32)
        b = mx.random.normal((n, n), dtype=mx.float32)
        mx.eval(a, b)
        mx.eval(a @ b)  # warm-up (kernel build, allocation)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(a @ b)
            best = min(best, time.perf_counter() - t0)
        where = "gpu" if mx.default_device() == mx.gpu else "cpu"
    else:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        c = np.empty((n, n), dtype=np.float32)
        np.matmul(a, b, out=c)  # warm-up (BLAS threads)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.matmul(a, b, out=c)
            best = min(best, time.perf_counter() - t0)
        where = f"{usable_cpus()} cpus"
    return {"peak_gflops": 2 * n**3 / best / 1e9, "peak_method": f"{method} f32 matmul {n}^2, {where}"}


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)
