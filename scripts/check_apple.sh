#!/usr/bin/env bash
# Type-check lily-core for macOS on Apple silicon (aarch64-apple-darwin) from Linux, without an
# Apple SDK: the Metal device layer (backend/metal/device.rs, objc2-metal), the macOS engine
# variant and tests/metal_device.rs are compiled with the real macOS cfgs, against the oldest
# supported macOS (MACOSX_DEPLOYMENT_TARGET=13.0, kernels::MIN_MACOS). `cargo check` never
# links, so no Apple linker or framework is needed; std for the target is built from source
# (-Zbuild-std) with Debian's rustc-web toolchain (1.96: rustc-web, cargo-web, rust-web-src),
# whose RUSTC_BOOTSTRAP=1 unlocks -Z flags. Uses its own target dir (target/apple-check).
# Then checks that the macOS build links CoreGraphics (lily-core's build script says so to
# cargo): without it MTLCreateSystemDefaultDevice returns nil in a command-line program or a
# Python extension, and the Metal backend would find no GPU on a Mac.
# Cold: about 1-5 minutes (std + dependencies); warm: seconds.
# Usage: scripts/check_apple.sh          (installs the Debian packages when missing: needs root)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d /usr/lib/rustlib/src/rust/library ] || ! /usr/bin/rustc --version 2>/dev/null | grep -q '^rustc 1\.9[0-9]'; then
  echo "== installing rustc-web cargo-web rust-web-src (Debian bookworm-security)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq rustc-web cargo-web rust-web-src >/dev/null
fi

echo "== $(/usr/bin/rustc --version): cargo check --target aarch64-apple-darwin -p lily-core (lib + tests)"
export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc RUSTC_BOOTSTRAP=1 MACOSX_DEPLOYMENT_TARGET=13.0
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR_APPLE:-target/apple-check}"
# Nothing here runs: no optimisation and no debug info for std and the dependencies (the
# workspace's dev profile asks for opt-level 3 on dependencies, which std would inherit).
check() {
  /usr/bin/cargo check -Zbuild-std=std,panic_abort --target aarch64-apple-darwin \
    --config 'profile.dev.package."*".opt-level=0' --config profile.dev.opt-level=0 --config profile.dev.debug=0 \
    -p lily-core --locked "$@"
}
check --lib --tests "$@"
echo "OK: lily-core type-checks for aarch64-apple-darwin"

echo "== the macOS build links the CoreGraphics framework"
check --lib --message-format=json 2>/dev/null | python3 -c '
import json, sys
libs = [lib for line in sys.stdin if line.startswith("{")
        for m in [json.loads(line)]
        if m.get("reason") == "build-script-executed" and "/crates/lily-core#" in m.get("package_id", "")
        for lib in m.get("linked_libs", [])]
if "framework=CoreGraphics" not in libs:
    sys.exit("FAILED: lily-core links " + repr(libs) + " for macOS, not framework=CoreGraphics "
             "(crates/lily-core/build.rs): MTLCreateSystemDefaultDevice would return nil")
print("OK: lily-core links " + ", ".join(libs) + " for aarch64-apple-darwin")
'
