//! Link directives that no Rust item carries.
//!
//! macOS: the CoreGraphics framework. Apple's documentation of `MTLCreateSystemDefaultDevice`
//! (https://developer.apple.com/documentation/metal/mtlcreatesystemdefaultdevice()): "In macOS,
//! in order for the system to provide a default Metal device object, you need to link to the
//! Core Graphics framework. You usually need to do this explicitly if you're writing apps that
//! don't use graphics by default, such as command line tools." A Python extension module and
//! `cargo test` binaries are such programs: without this line the Metal backend would find no
//! device on a Mac. `scripts/check_apple.sh` fails when the macOS build loses it.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        println!("cargo:rustc-link-lib=framework=CoreGraphics");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
