#!/usr/bin/env bash
# Fuzz the checkpoint-facing parsers (issue 17) for a bounded time each: the safetensors header,
# config.json and the matrix descriptors (fuzz/fuzz_targets/). Runs on the stable toolchain through
# cargo-fuzz without a sanitizer (RUSTC_BOOTSTRAP=1 unlocks the -Z flags it passes; debug assertions
# on, so arithmetic overflow is a finding like a panic). The corpus kept in the repo
# (fuzz/corpus/<target>) is read, never written: new inputs go to a scratch folder. A crash fails
# the script and leaves the input under fuzz/artifacts/<target>/ (reproduce with
# `RUSTC_BOOTSTRAP=1 cargo fuzz run <target> -s none -a <file>`).
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]   (default 20; CI uses the default, longer on demand)
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-20}"
if ! command -v cargo-fuzz >/dev/null; then
    cargo install cargo-fuzz --locked --version 0.13.2 >/dev/null
fi
export RUSTC_BOOTSTRAP=1
cd fuzz
cargo fuzz build -s none -a -O >/dev/null
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
for t in safetensors_header config matrix; do
    mkdir -p "$scratch/$t" "corpus/$t"
    echo "== fuzz $t for ${secs}s"
    if ! cargo fuzz run "$t" -s none -a -O "$scratch/$t" "corpus/$t" -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 >"$scratch/$t.log" 2>&1; then
        tail -40 "$scratch/$t.log"
        echo "FAILED: fuzz target $t found a crash (input under fuzz/artifacts/$t/)"
        exit 1
    fi
    grep -E "^Done" "$scratch/$t.log"
done
