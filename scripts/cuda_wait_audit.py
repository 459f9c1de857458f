#!/usr/bin/env python3
"""Which global loads each CUDA kernel issues before its programmatic-launch wait, from the SASS.

`python3 scripts/cuda_wait_audit.py [--src DIR] [--arch 90] [REGEX]` compiles every shaders/cuda/*.cu
(or those of DIR, laid out as shaders/) with NVRTC and the backend's options, disassembles the cubins
with nvdisasm, and prints for each kernel whose name matches REGEX its global loads and waits in
program order, runs compressed: `ACQ` is griddepcontrol.wait (SASS ACQBULK); `EF...` a streamed
weight load (load_stream), `STRONG.GPU` an L2-only load (load_l2), `CONSTANT` an ld.global.nc load
(`const __restrict__`, __ldg), `E` a plain load. Before a kernel's wait only weights and what earlier
forward calls wrote may be read (shaders/cuda/common.cuh, grid_dep_wait): a `CONSTANT` or `E` load
of another input ahead of an `ACQ` reads it stale under programmatic launch, and ptxas may move one
there (it did, 2026-12-07). Needs NVRTC (LILY_NVRTC, as scripts/check_cuda.sh) and nvdisasm
(`pip install "nvidia-cuda-nvdisasm>=13,<14"`; NVDISASM overrides where it is looked for).
"""

import argparse
import ctypes
import glob
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

OPTIONS = [b"-std=c++17", b"--device-as-default-execution-space", b"-default-device"]  # nvrtc.rs OPTIONS


def nvrtc():
    path = os.environ.get("LILY_NVRTC")
    if not path:  # the package's own search (lily/_nvrtc.py), without importing the package
        spec = importlib.util.spec_from_file_location(
            "lily_nvrtc", os.path.join(os.path.dirname(__file__), "..", "python", "lily", "_nvrtc.py")
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        path = mod.wheel_nvrtc()
    if not path:
        sys.exit("NVRTC not found: pip install nvidia-cuda-nvrtc (or set LILY_NVRTC)")
    # NVRTC opens its builtins library by name: load the one beside it first.
    for b in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*")):
        if ".alt." not in b:
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            break
    return ctypes.CDLL(path)


def nvdisasm(lib_path):
    tool = os.environ.get("NVDISASM")
    if tool:
        return tool
    here = os.path.join(os.path.dirname(os.path.dirname(lib_path)), "bin", "nvdisasm")
    if os.path.exists(here):
        return here
    sys.exit("nvdisasm not found: pip install 'nvidia-cuda-nvdisasm>=13,<14' (or set NVDISASM)")


def compile_cubin(lib, src_dir, name, arch):
    def read(p):
        with open(p, "rb") as f:
            return f.read()

    headers = [
        (b"params.h", read(os.path.join(src_dir, "params.h"))),
        (b"common.cuh", read(os.path.join(src_dir, "cuda", "common.cuh"))),
    ]
    arr = lambda xs: (ctypes.c_char_p * len(xs))(*xs)  # noqa: E731
    prog = ctypes.c_void_p()
    src = read(os.path.join(src_dir, "cuda", name))
    if (
        lib.nvrtcCreateProgram(
            ctypes.byref(prog),
            src,
            name.encode(),
            len(headers),
            arr([h[1] for h in headers]),
            arr([h[0] for h in headers]),
        )
        != 0
    ):
        sys.exit(f"NVRTC: cannot create a program for {name}")
    opts = [f"--gpu-architecture=sm_{arch}".encode()] + OPTIONS
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr(opts))
    if rc != 0:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(f"{name} does not compile for sm_{arch}:\n{log.value.decode()}")
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    return buf.raw


def events(sass):
    """(kernel, [load kind | 'ACQ' | 'EXIT' in program order]) for each kernel of a disassembly."""
    parts = re.split(r"\n\.text\.(\w+):\n", sass)
    for name, body in zip(parts[1::2], parts[2::2]):
        ev = []
        for line in body.splitlines():
            if "ACQBULK" in line:
                ev.append("ACQ")
            elif re.search(r"\bEXIT\b", line):
                ev.append("EXIT")
            else:
                m = re.search(r"\bLDG(\.[A-Z0-9.]+)?\b", line)
                if m:
                    ev.append((m.group(1) or ".plain").removeprefix(".E.").removeprefix(".") or "E")
        yield name, ev


def compress(ev):
    runs = []
    for e in ev:
        if runs and runs[-1][0] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, 1])
    return " ".join(f"{e}x{n}" if n > 1 else e for e, n in runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("regex", nargs="?", default=".", help="kernels whose name matches (default: all)")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", "shaders"))
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    lib = nvrtc()
    tool = nvdisasm(os.environ.get("LILY_NVRTC") or lib._name)
    with tempfile.TemporaryDirectory() as tmp:
        for cu in sorted(glob.glob(os.path.join(a.src, "cuda", "*.cu"))):
            cubin = os.path.join(tmp, os.path.basename(cu) + ".cubin")
            with open(cubin, "wb") as f:
                f.write(compile_cubin(lib, a.src, os.path.basename(cu), a.arch))
            sass = subprocess.run([tool, cubin], capture_output=True, text=True, check=True).stdout
            for name, ev in events(sass):
                if re.search(a.regex, name) and "ACQ" in ev:
                    print(f"{name}: {compress(ev)}")


if __name__ == "__main__":
    main()
