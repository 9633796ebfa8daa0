//! Build script. CUDA kernels in kernels/ are compiled here when the `cuda`
//! feature lands; CPU-only builds need nothing from this script.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
}
