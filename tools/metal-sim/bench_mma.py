"""Speed of the EXEC runtime on Lily's prefill GEMM (shaders/metal/matmul.metal matmul_mma_f32_n64), and a
hash of its output, for A/B runs of two preludes (the output must be the same bit for bit).

usage: python3 bench_mma.py REPO INCLUDE_DIR TAG [T,N,K] [forward|reverse]
  REPO: a Lily checkout (its shaders/); INCLUDE_DIR: a tools/metal-sim/include (the prelude to time).
  MTL_THREADS sets the OS threads (1: the per-core speed); BOUNDS=1 turns bounds checking on.
Prints wall and CPU seconds of the dispatch, multiply-adds per second and the output's hash."""
import ctypes, hashlib, os, shutil, subprocess, sys, tempfile, time
import numpy as np

repo, inc, tag = sys.argv[1], sys.argv[2], sys.argv[3]
T, N, K = [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "64,256,1024").split(",")]
sched = sys.argv[5] if len(sys.argv) > 5 else "forward"
d = tempfile.mkdtemp(prefix=f"bench-mma-{tag}-")
for f in os.listdir(inc):
    shutil.copy(os.path.join(inc, f), d)
shutil.copy(f"{repo}/shaders/metal/common.h", d)
shutil.copy(f"{repo}/shaders/params.h", d)
here = os.path.dirname(os.path.abspath(__file__))
subprocess.run([sys.executable, f"{here}/mtl_lower.py", f"{repo}/shaders/metal/matmul.metal", f"{d}/m.cpp"], check=True)
# The flags of crates/lily-core/src/backend/metal/sim.rs.
subprocess.run(["clang++-19", "-x", "c++", "-std=c++20", "-O2", "-fPIC", "-shared", "-DMTL_EXEC", "-DMTL_NO_BFLOAT",
                "-w", "-I", d, f"{d}/m.cpp", "-o", f"{d}/m.so"], check=True)
lib = ctypes.CDLL(f"{d}/m.so")
lib.mtl_set_schedule(1 if sched == "reverse" else 0)
rng = np.random.default_rng(0)
x = rng.standard_normal((T, K), dtype=np.float32)
w = rng.standard_normal((N, K), dtype=np.float32)
out = np.zeros((T, N), np.float32)
bufs = [np.array([T, 0], np.uint32), np.array([N, K, 0, 0, 0, 0, 0, 0], np.uint32), w,
        np.zeros(16, np.float32), np.zeros(16, np.float32), x, out]
get = lib.mtl_kernel_matmul_mma_f32_n64
get.restype = ctypes.c_void_p
fn = get()
ptrs = (ctypes.c_void_p * 7)(*[b.ctypes.data for b in bufs])
sizes = (ctypes.c_ulong * 7)(*[b.nbytes for b in bufs])
tgb = (ctypes.c_ulong * 2)(32 * 32 * 4, 64 * 32 * 4)
U3 = ctypes.c_uint * 3
lib.mtl_dispatch.restype = ctypes.c_int
lib.mtl_dispatch.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
bounds = os.environ.get("BOUNDS", "0") == "1"
for _ in range(2):
    out[:] = 0
    t, c = time.time(), time.process_time()
    rc = lib.mtl_dispatch(fn, U3((N + 63) // 64, (T + 31) // 32, 1), U3(128, 1, 1), None, ptrs,
                          sizes if bounds else None, 7, tgb, 2)
    dt, cpu = time.time() - t, time.process_time() - c
    assert rc == 0, rc
    err = np.abs(out - x.astype(np.float64) @ w.astype(np.float64).T).max()
    print(f"{tag}: {dt:.3f} s (cpu {cpu:.3f} s), {T * N * K / dt / 1e6:.1f} M multiply-adds/s, max err {err:.2e}, "
          f"output sha1 {hashlib.sha1(out.tobytes()).hexdigest()[:12]}")
shutil.rmtree(d)
