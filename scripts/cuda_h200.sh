#!/usr/bin/env bash
# The whole CUDA measurement on a GPU machine with no internet (the H200 of issue 20), in one script:
#   1. install the carried Lily wheel (and the carried test wheels: mlx, mlx-lm, gguf) into /tmp/site;
#   2. run the CUDA tests: the Rust GPU test binary (every kernel against the reference, decode graphs)
#      and tests/test_cuda_device.py (the tiny oracle checkpoints against MLX-LM, a full-width synthetic
#      checkpoint against the CPU backend);
#   3. write the full 40-layer synthetic checkpoint (`lily synth --layers 40`) and a GGUF of the same
#      shapes at the same bits per weight (gen_gguf.py, Q4_0), build llama.cpp with CUDA from the carried
#      sdist (once: the build is kept in $WORK and reused by a later call while the machine is warm);
#   4. measure both engines one after the other, nothing else running: `lily bench --backend cuda`
#      (prefill 512 / 4096, decode at depth 512 / 4096 and 32768, GPU bandwidth measured in the same run,
#      peak GPU memory) and `llama-bench -ngl 99 -fa 1` (prefill 512 / 4096, decode at depth 0 / 4096 and
#      32768); print the ratios;
#   5. (profile) per-kernel times of a 4096-token prefill and of decode steps (CUDA events,
#      LILY_CUDA_PROFILE=1: inside the replayed decode graph), and both speeds unprofiled, with
#      programmatic dependent launch on and off (LILY_CUDA_PDL=0).
#
# What it needs beside the checkout, under $DEV (default .dev, an ignored folder named in the device
# call's `carry`; make it with `scripts/cuda_h200.sh pack` on the development machine):
#   $DEV/whl/*.whl                       lily (built here), mlx, mlx-cpu, mlx-lm, gguf
#   $DEV/bin/cuda_device, ops_*          the Rust GPU test binaries (cargo test --test cuda_device --test
#                                        'ops_*' --no-run: each op kernel's cuda_device:: cases are in its
#                                        family's ops_<family>, the CPU kernels' cpu:: cases beside them),
#                                        attention (the CPU decode attention bench), decode_profile (example)
#   $DEV/tests/                          the Python tests and their helpers, $DEV/fixtures/oracle: cached MLX-LM logits,
#   $DEV/python/lily/                    the two package sources conftest.py reads beside the tests
#   $DEV/llamacpp/llama.cpp.tar.gz       llama.cpp from the llama-cpp-python 0.3.36 sdist, trimmed to the
#                                        CPU and CUDA backends and llama-bench (~7 MB instead of 77)
#   $DEV/llamacpp/gen_gguf.py, template/      the GGUF generator (shared/tools/llamacpp-compare)
#
# Usage (on the GPU machine): scripts/cuda_h200.sh PHASE...
#   test     step 2 (the Rust and Python GPU tests)
#   synth    the 40-layer checkpoint only (step 3 without llama.cpp)
#   llama    llama.cpp's build and its GGUF (step 3's other half; the build runs in the background
#            until a later phase of the same call waits for it)
#   setup    test + synth + llama
#   bench    step 4 (llama-bench and the ratios only where llama.cpp was built)
#   profile  per-kernel profiles (CUDA events) of one 4096-token prefill and of 64 decode steps, and
#            both speeds without profiling, one engine each (after synth)
#   splits   decode tok/s at depth ~512 and ~4100 for 32, 64, 128 and 256 attention key splits (or those in SPLITS)
#            (LILY_CUDA_DECODE_SPLITS; after synth)
#   cpu      the host's CPU, GPU hidden (CUDA_VISIBLE_DEVICES=): the CPU kernel tests (the test binaries'
#            CPU cases, on the host's ISA), a 4-layer full-width checkpoint and its GGUF; lily bench
#            --compare llama.cpp at 2 threads (taskset) and at all cores, prefill 256 / 4096 and decode at
#            those depths, once per CPU precision in PRECISION (default "exact"; PRECISION="exact fast"
#            runs both, the fast records as cpu2-fast.json, cpuN-fast.json) (after llama, which builds
#            llama-bench)
#   depth    the host's CPU: python -m lily.bench.depth at 4K, 32K (prefilled, beside llama-bench -d) and
#            128K, 255K (fill_context): decode tok/s, bytes per token, peak memory (after llama)
#   ncu      Nsight Compute on two decode steps (graph nodes) of the 4-layer checkpoint after a 4096-token
#            prefill: per kernel its duration without event overhead, DRAM throughput, occupancy and
#            warp stall reasons ($OUT/ncu_decode.csv, .ncu-rep; needs the Firecracker runtime, where ncu
#            reads the counters)
#   extras   the host's CPU, GPU hidden: the decode attention kernel alone (bf16 / f16 / f32 KV at 32K and
#            128K, all cores and 2; bf16 also without avx512_bf16 where the CPU has it), batched decode
#            (lily bench --concurrency 1,2,4,8 at all cores and 2)
#            and the CPU profile of a batched step at B = 1 and 4 (decode_profile, all cores; after cpu, which
#            writes the 4-layer checkpoint); the last two once per CPU precision in PRECISION (default "exact";
#            PRECISION=fast: the one-plane batched kernels, records as concurrencyN-fast.json)
# Step 1 (installing the carried wheels) runs first in every call.
# A device command is limited to 10 minutes: run `setup` in one call and `bench` in the next, back to
# back (the machine keeps $WORK only while it stays warm, 30 s after a call). Output also goes to
# $OUT/cuda_h200.log when $OUT is set. On the development machine, `scripts/cuda_h200.sh pack` fills
# $DEV (use a folder of its own, e.g. DEV=.dev/h200: pack empties it first) and writes $DEV.tar.xz, the one
# file to carry (the folder itself is too big for a call); every call unpacks it again (a warm machine keeps
# $WORK, not the checkout's ignored folders), then runs the phases from the unpacked copy of this script.
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=$(realpath -m "${DEV:-.dev}")
WORK=${WORK:-/tmp/lily-h200}
[ $# -gt 0 ] || { sed -n "2,/^set -uo/p" "$0" | sed "\$d"; exit 2; }
PHASES=" $* "
PHASE=$1
mkdir -p "$WORK"
if [ -n "${OUT:-}" ]; then exec > >(tee -a "$OUT/cuda_h200.log") 2>&1; fi
export PYTHONUNBUFFERED=1

if [ "$PHASE" = pack ]; then
    # On the development machine: fill $DEV from this checkout and the shared tools.
    set -e
    compare=${LLAMACPP_COMPARE:-../shared/tools/llamacpp-compare}
    [ -f "$compare/gen_gguf.py" ] || { echo "set LLAMACPP_COMPARE to shared/tools/llamacpp-compare"; exit 1; }
    rm -rf "$DEV" && mkdir -p "$DEV"/{whl,bin,tests,fixtures/oracle,llamacpp}
    maturin build --release -o "$DEV/whl"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 -d "$DEV/whl" \
        mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 gguf==0.19.0
    # Test binaries by target name: the GPU tests, and the CPU kernel tests for the host's ISA (AVX-512
    # VNNI / bf16 paths that an AVX2-only development machine cannot run); the attention bench.
    cargo test -p lily-core --release --locked --no-run --message-format=json --test cuda_device \
        --test cpu_simd --test cpu_int8 --test 'ops_*' |
        python3 -c 'import json, shutil, sys
for m in map(json.loads, sys.stdin):
    if m.get("executable"):
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])' "$DEV/bin"
    cargo bench -p lily-core --bench attention --no-run --message-format=json |
        python3 -c 'import json, shutil, sys
for m in map(json.loads, sys.stdin):
    if m.get("executable"):
        shutil.copy(m["executable"], sys.argv[1] + "/attention")' "$DEV/bin"
    cargo build -p lily-core --release --locked --example decode_profile
    cp target/release/examples/decode_profile "$DEV/bin/"
    strip "$DEV"/bin/*   # the device call carries at most 64 MiB with the checkout
    cp tests/{conftest,fixtures,oracle,test_oracle,gpu_sim,test_cuda_sim,test_cuda_device}.py "$DEV/tests/"
    # conftest.py keys its fixture caches on these sources, read beside the tests.
    mkdir -p "$DEV/python/lily" && cp python/lily/{tokenizer_files,mlx_reference}.py "$DEV/python/lily/"
    cp tests/.fixtures/oracle/*-mlx_logits-*.npy "$DEV/fixtures/oracle/" 2>/dev/null || true
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
    (cd "$tmp"/llama_cpp_python-0.3.36/vendor && cd llama.cpp &&
        rm -rf models docs tests benches examples tools/ui &&
        for b in ggml/src/ggml-*/; do case "$b" in *ggml-cpu/|*ggml-cuda/) ;; *) rm -rf "$b" ;; esac; done &&
        cd .. && tar czf "$DEV/llamacpp/llama.cpp.tar.gz" llama.cpp)
    rm -rf "$tmp"
    cp -r "$compare"/{gen_gguf.py,template} "$DEV/llamacpp/"
    cp scripts/cuda_h200.sh "$DEV/"
    # One xz archive: the folder (~66 MB: wheel, test binaries, fixtures, llama.cpp) plus the checkout exceed
    # the device call's 64 MiB carry; compressed it is ~44 MB. The call unpacks it before the phases run.
    rm -f "$DEV.tar.xz" && tar -cJf "$DEV.tar.xz" -C "$(dirname "$DEV")" "$(basename "$DEV")"
    du -sh "$DEV" "$DEV.tar.xz"
    rel=$(realpath --relative-to=. "$DEV")
    echo "device call: carry [\"$rel.tar.xz\"], command: tar xJf $rel.tar.xz -C $(dirname "$rel") && cd $rel &&" \
        "DEV=\$PWD WORK=/tmp/lily-h200 OUT=\$OUT bash cuda_h200.sh setup bench"
    exit 0
fi

step() { printf '\n=== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

step "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$DEV"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
export LILY_CUDA_CACHE="$WORK/kernels"   # NVRTC cubins, compiled once per machine
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv
python3 -c 'import lily, sys; print("lily", lily.__file__, "python", sys.version.split()[0])'

SYNTH="$WORK/synth40"
GGUF="$WORK/synth40.gguf"
LLAMA="$WORK/llama.cpp/build/bin/llama-bench"
SYNTH4="$WORK/synth4"        # the 4-layer full-width checkpoint of the CPU phases, and its GGUF
GGUF4="$WORK/synth4.gguf"
synth4() { [ -f "$SYNTH4/config.json" ] || python3 -m lily synth "$SYNTH4" --layers 4 -q || fail=1; }
fail=0
want() { for p in "$@"; do case "$PHASES" in *" $p "*) return 0 ;; esac; done; return 1; }
if want setup llama; then
    step "build llama.cpp (CUDA, sm_90) in the background (about 4 minutes on 16 cores)"
    if [ ! -x "$LLAMA" ]; then
        (
            src="$DEV/llamacpp/llama.cpp.tar.gz" &&
            cd "$WORK" && rm -rf llama.cpp && tar xzf "$src" && cd llama.cpp &&
            cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
                -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
                -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
                > "$WORK/llama-build.log" 2>&1 &&
            ninja -C build llama-bench >> "$WORK/llama-build.log" 2>&1
        ) &
        build=$!
    fi
fi

if want setup test; then
    step "Rust GPU tests: every kernel against the reference (ops_<family> cuda_device::), argmax, the tiny model end to end, decode graphs"
    "$DEV/bin/cuda_device" --test-threads=1 || fail=1
    for t in "$DEV"/bin/ops_*; do
        "$t" cuda_device:: --test-threads=1 || { echo "FAILED: $(basename "$t") cuda_device::"; fail=1; }
    done
    step "Python GPU tests: tiny oracle checkpoints vs MLX-LM, full-width synthetic vs the CPU backend"
    mkdir -p "$WORK/fixtures/oracle" && cp -n "$DEV"/fixtures/oracle/*.npy "$WORK/fixtures/oracle/" 2>/dev/null
    LILY_TEST_FIXTURES="$WORK/fixtures" python3 -m pytest -q -p no:cacheprovider --rootdir "$DEV/tests" \
        "$DEV/tests/test_cuda_device.py" || fail=1
fi

if want setup synth; then
    step "write the 40-layer checkpoint (lily synth --layers 40: full width, MLX 4-bit)"
    [ -f "$SYNTH/config.json" ] || python3 -m lily synth "$SYNTH" --layers 40 -q || fail=1
    du -sh "$SYNTH"; df -h "$WORK" | tail -1
fi
if want setup llama; then
    step "the GGUF of the same shapes (gen_gguf.py, Q4_0); wait for the llama.cpp build"
    [ -f "$GGUF" ] || python3 "$DEV/llamacpp/gen_gguf.py" write "$DEV/llamacpp/template" "$GGUF" --layers 40 || fail=1
    if [ -n "${build:-}" ]; then
        wait "$build" || { tail -30 "$WORK/llama-build.log"; fail=1; }
    fi
    ls -la "$LLAMA" "$GGUF"
fi

if want bench; then
    step "lily bench --backend cuda (40 layers): prefill 512 / 4096, decode at those depths"
    python3 -m lily bench "$SYNTH" --backend cuda --lengths 512,4096 --decode-steps 128 --rounds 2 \
        --max-seq 8192 --json "$WORK/lily.json" || fail=1
    step "lily bench --backend cuda (40 layers): decode at depth 32768 (a long agent context)"
    python3 -m lily bench "$SYNTH" --backend cuda --lengths 32768 --decode-steps 64 --rounds 2 \
        --max-seq 33280 --json "$WORK/lily32k.json" || fail=1
    if [ -x "$LLAMA" ]; then
        step "llama-bench (CUDA, -ngl 99 -fa 1): prefill 512 / 4096, decode 128 at depth 0 / 4096, 64 at 32768"
        "$LLAMA" -m "$GGUF" -ngl 99 -fa 1 -p 512,4096 -n 128 -d 0,4096 -o json > "$WORK/llama.json" || fail=1
        "$LLAMA" -m "$GGUF" -ngl 99 -fa 1 -p 0 -n 64 -d 32768 -r 2 -o json > "$WORK/llama32k.json" || fail=1
    else
        echo "llama.cpp is not built on this machine (run the llama or setup phase first): no ratios"
        echo '[]' > "$WORK/llama.json"
        echo '[]' > "$WORK/llama32k.json"
    fi
    step "ratios"
    python3 - "$WORK/lily.json" "$WORK/llama.json" "$WORK/lily32k.json" "$WORK/llama32k.json" <<'EOF'
import json, sys
lily = json.load(open(sys.argv[1]))
llama = json.load(open(sys.argv[2])) + json.load(open(sys.argv[4]))
rec = {r["prompt_tokens"]: r for r in lily["records"] + json.load(open(sys.argv[3]))["records"]}
def ll(kind, n, depth):
    for r in llama:
        if kind == "pp" and r["n_prompt"] == n and r["n_gen"] == 0 and r.get("n_depth", 0) == depth:
            return r["avg_ts"]
        if kind == "tg" and r["n_gen"] == n and r["n_prompt"] == 0 and r.get("n_depth", 0) == depth:
            return r["avg_ts"]
rows = [("prefill 512", rec[512]["prefill_tok_s"], ll("pp", 512, 0)),
        ("prefill 4096", rec[4096]["prefill_tok_s"], ll("pp", 4096, 0)),
        ("decode @512 (llama.cpp @0)", rec[512]["decode_tok_s"], ll("tg", 128, 0)),
        ("decode @4096", rec[4096]["decode_tok_s"], ll("tg", 128, 4096)),
        ("decode @32768", rec[32768]["decode_tok_s"], ll("tg", 64, 32768))]
print(f"{'':28} {'lily tok/s':>12} {'llama.cpp':>12} {'ratio':>7}")
for name, a, b in rows:
    print(f"{name:28} {a:12.1f} {b or float('nan'):12.1f} {a / b if b else float('nan'):7.2f}")
m = lily["meta"]
print(f"GPU copy bandwidth {m['memory_bandwidth_gbps']:.0f} GB/s; decode reads "
      f"{rec[512]['decode_bytes_per_token'] / 1e6:.0f} MB/token = {100 * rec[512]['decode_bandwidth_fraction']:.0f} % "
      f"of it at 512; peak GPU memory {rec[4096]['peak_memory_bytes'] / 1e9:.2f} GB "
      f"(weights {lily['meta']['bytes_model']['weights_total'] / 1e9:.2f} GB), "
      f"{rec[32768]['peak_memory_bytes'] / 1e9:.2f} GB at depth 32768")
EOF
fi

if want profile; then
    for pdl in 1 0; do
    step "speeds without profiling, LILY_CUDA_PDL=$pdl (programmatic dependent launch on / off): a 4096-token prefill (second of two), 64 greedy decode steps after it"
    LILY_CUDA_PDL=$pdl python3 - "$SYNTH" <<'EOF' || fail=1
import sys, time, lily
t = time.perf_counter()
eng = lily.Engine(sys.argv[1], backend="cuda", max_seq=8192)
print(f"load {time.perf_counter() - t:.1f} s; {eng.device}; GPU copy bandwidth {eng.measure_device_bandwidth():.0f} GB/s")
prompt = [1 + (i * 7919) % 240000 for i in range(4096)]
for i in range(2):
    eng.reset()
    t = time.perf_counter()
    eng.prefill(prompt)
    s = time.perf_counter() - t
    print(f"prefill 4096 (run {i + 1}): {s * 1e3:.0f} ms = {4096 / s:.0f} tok/s")
tok = 1
for _ in range(4):
    tok = eng.decode_greedy(tok)
t = time.perf_counter()
for _ in range(64):
    tok = eng.decode_greedy(tok)
s = time.perf_counter() - t
print(f"decode at depth ~4100: 64 steps {s * 1e3:.0f} ms = {64 / s:.1f} tok/s ({s / 64 * 1e6:.0f} us/step)")
print(f"peak GPU memory {eng.device_peak_bytes / 1e9:.2f} GB, KV cache {eng.kv_bytes / 1e6:.1f} MB")
EOF
    done
    step "per-kernel profile: one 4096-token prefill (4 chunks of 1024; CUDA events; PDL off while profiling)"
    LILY_CUDA_PROFILE=1 python3 -c 'import sys, lily
eng = lily.Engine(sys.argv[1], backend="cuda", max_seq=8192)
eng.prefill([1 + (i * 7919) % 240000 for i in range(4096)])' "$SYNTH" 2>&1 | head -45
    step "per-kernel profile: a 1-token prefill + 64 greedy decode steps (CUDA event nodes inside the replayed graph; PDL off while profiling)"
    LILY_CUDA_PROFILE=1 python3 -c 'import sys, lily
eng = lily.Engine(sys.argv[1], backend="cuda", max_seq=8192)
eng.prefill([1])
tok = 1
for _ in range(64):
    tok = eng.decode_greedy(tok)' "$SYNTH" 2>&1 | head -90
fi
if want splits; then
    for s in ${SPLITS:-32 64 128 256}; do
    step "decode speed with LILY_CUDA_DECODE_SPLITS=$s (attention key splits): 64 greedy steps at depth ~512 and ~4100"
    LILY_CUDA_DECODE_SPLITS=$s python3 - "$SYNTH" <<'PY' || fail=1
import sys, time, lily
eng = lily.Engine(sys.argv[1], backend="cuda", max_seq=8192)
for depth in (512, 4096):
    eng.reset()
    eng.prefill([1 + (i * 7919) % 240000 for i in range(depth)])
    tok = 1
    for _ in range(4):
        tok = eng.decode_greedy(tok)
    t = time.perf_counter()
    for _ in range(64):
        tok = eng.decode_greedy(tok)
    s = time.perf_counter() - t
    print(f"depth ~{depth + 4}: {64 / s:.1f} tok/s ({s / 64 * 1e6:.0f} us/step)")
PY
    done
fi
if want cpu; then
    step "the 4-layer full-width checkpoint for the CPU measurements"
    synth4
    cores=$(nproc)
    step "CPU kernel tests on this host's ISA (its AVX-512 paths do not run on an AVX2-only machine)"
    grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
    # cpu_simd and cpu_int8 whole (every ISA the host has against the reference); the ops files' cpu cases.
    for t in cpu_simd cpu_int8 "ops_attention cpu::" "ops_matmul cpu::" "ops_moe cpu::" "ops_delta_net cpu::" \
        "ops_norm cpu::" "ops_elementwise cpu::" "ops_embed cpu::"; do
        set -- $t
        CUDA_VISIBLE_DEVICES= "$DEV/bin/$1" ${2:-} -q || { echo "FAILED: $t"; fail=1; }
    done
    for prec in ${PRECISION:-exact}; do
        sfx=$([ "$prec" = exact ] || echo "-$prec")
        step "CPU, 2 threads (taskset -c 0,1), precision $prec: Lily vs llama.cpp, prefill 256 / 4096, decode at those depths"
        CUDA_VISIBLE_DEVICES= taskset -c 0,1 python3 -m lily bench "$SYNTH4" --backend cpu --lengths 256,4096 \
            --decode-steps 32 --rounds 2 --threads 2 --compare llama.cpp --llama-bench "$LLAMA" --gguf "$GGUF4" \
            --precision "$prec" --json "$WORK/cpu2$sfx.json" || fail=1
        step "CPU, $cores threads, precision $prec: Lily vs llama.cpp, prefill 256 / 4096, decode at those depths"
        CUDA_VISIBLE_DEVICES= python3 -m lily bench "$SYNTH4" --backend cpu --lengths 256,4096 \
            --decode-steps 32 --rounds 2 --threads "$cores" --compare llama.cpp --llama-bench "$LLAMA" --gguf "$GGUF4" \
            --precision "$prec" --json "$WORK/cpu$cores$sfx.json" || fail=1
    done
    [ -n "${OUT:-}" ] && cp "$WORK"/cpu*.json "$OUT/" 2>/dev/null
fi
if want depth; then
    cores=$(nproc)
    synth4
    step "CPU, $cores threads: long context (4K, 32K prefilled beside llama-bench -d; 128K, 255K by fill_context)"
    CUDA_VISIBLE_DEVICES= LILY_THREADS=$cores python3 -m lily.bench.depth "$SYNTH4" --backend cpu \
        --depths 4K,32K,128K,255K --prefill-upto 32K --decode-steps 16 --llama-bench "$LLAMA" --gguf "$GGUF4" \
        --llama-reps 1 --json "$WORK/depth.json" || fail=1
    [ -n "${OUT:-}" ] && cp "$WORK/depth.json" "$OUT/" 2>/dev/null
fi
if want ncu; then
    synth4
    step "Nsight Compute: two decode steps at depth ~4100 of the 4-layer checkpoint (cuProfilerStart/Stop around them)"
    ncu --version | tail -1
    cat > "$WORK/ncu_decode.py" <<'EOF'
import ctypes, sys, lily
eng = lily.Engine(sys.argv[1], backend="cuda", max_seq=8192)
eng.prefill([1 + (i * 7919) % 240000 for i in range(4096)])
tok = 1
for _ in range(4):
    tok = eng.decode_greedy(tok)
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuProfilerStart() == 0, "cuProfilerStart"
for _ in range(2):
    tok = eng.decode_greedy(tok)
assert cuda.cuProfilerStop() == 0, "cuProfilerStop"
EOF
    rep="${OUT:-$WORK}/ncu_decode"
    ncu --clock-control none --profile-from-start off --graph-profiling node --target-processes all \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats -f -o "$rep" \
        python3 "$WORK/ncu_decode.py" "$SYNTH4" > "$WORK/ncu.log" 2>&1 || { tail -30 "$WORK/ncu.log"; fail=1; }
    tail -5 "$WORK/ncu.log"
    ncu --import "$rep.ncu-rep" --csv --page details > "$rep.csv" || fail=1
    # One line per kernel launch: duration (no event overhead), DRAM throughput, registers, grid.
    python3 - "$rep.csv" <<'PY' || fail=1
import collections, csv, sys
launches = collections.OrderedDict()
for r in csv.DictReader(open(sys.argv[1])):
    launches.setdefault((r["ID"], r["Kernel Name"], r["Grid Size"]), {})[r["Metric Name"]] = r["Metric Value"]
total = 0.0
for (i, name, grid), m in launches.items():
    us = float(m.get("Duration", "0").replace(",", ""))
    total += us
    print(f"{i:>4} {name[:30]:30} {grid:>14} {us:8.2f} us  DRAM {m.get('DRAM Throughput', '-'):>6} %  "
          f"{m.get('Registers Per Thread', '-')} regs  occupancy {m.get('Achieved Occupancy', '-')} %")
print(f"{len(launches)} launches, {total:.1f} us of kernel time")
PY
fi
if want extras; then
    cores=$(nproc)
    synth4
    for t in "$cores" 2; do
        pin=""; [ "$t" = 2 ] && pin="taskset -c 0,1"
        step "decode attention alone, $t threads: bf16 / f16 / f32 KV at 32K and 128K"
        CUDA_VISIBLE_DEVICES= LILY_THREADS=$t $pin "$DEV/bin/attention" --context 32768,131072 \
            --dtype bf16,f16,f32 || fail=1
        if grep -qw avx512_bf16 /proc/cpuinfo; then
            # bf16 KV without avx512_bf16 (the widening kernels) beside the default (vdpbf16ps).
            step "decode attention alone, $t threads, bf16 KV without avx512_bf16 (--isa avx512)"
            CUDA_VISIBLE_DEVICES= LILY_THREADS=$t $pin "$DEV/bin/attention" --context 32768,131072 \
                --dtype bf16 --isa avx512 || fail=1
        fi
    done
    lscpu 2>/dev/null | grep -i 'model name\|thread(s) per core\|core(s) per socket\|socket(s)\|max mhz' || true
    for prec in ${PRECISION:-exact}; do
        sfx=$([ "$prec" = exact ] || echo "-$prec")
        for t in "$cores" 2; do
            pin=""; [ "$t" = 2 ] && pin="taskset -c 0,1"
            step "batched decode, $t threads, precision $prec: lily bench --concurrency 1,2,4,8 (prompts of 256)"
            CUDA_VISIBLE_DEVICES= $pin python3 -m lily bench "$SYNTH4" --backend cpu --concurrency 1,2,4,8 \
                --lengths 256 --decode-steps 32 --threads "$t" --precision "$prec" \
                --json "$WORK/concurrency$t$sfx.json" || fail=1
        done
        step "batched decode, $cores threads, precision $prec: CPU profile of 32 steps at B = 1 and B = 4 (kernels' sum vs wall)"
        for b in 1 4; do
            CUDA_VISIBLE_DEVICES= LILY_THREADS=$cores LILY_CPU_PROFILE=1 "$DEV/bin/decode_profile" "$SYNTH4" 32 256 $b \
                "$prec" || fail=1
        done
    done
    [ -n "${OUT:-}" ] && cp "$WORK"/concurrency*.json "$OUT/" 2>/dev/null
fi
exit $fail
