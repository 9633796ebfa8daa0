//! Build script.
//!
//! - With the `cuda` feature: compiles each kernels/*.cu to PTX with nvcc
//!   (`KVRUN_NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH) for
//!   compute capability 8.0 (PTX is JIT-compiled by the driver for the GPU
//!   it runs on, so one PTX serves A100, H100 and H200), and writes
//!   `$OUT_DIR/ptx.rs` with the PTX texts for the binary to embed. Without
//!   nvcc the binary has no kernels and `--device cuda` says so;
//!   `KVRUN_REQUIRE_NVCC=1` makes a missing nvcc or a kernel that does not
//!   compile a build failure instead.
//! - Always: compiles kernels/quant_host.c (the weight-format decoding of
//!   kernels/quant.cuh, built for the host) so the tests can check it
//!   against the CPU dequantizers on machines without a GPU.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=KVRUN_NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=KVRUN_REQUIRE_NVCC");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));

    cc::Build::new()
        .file("kernels/quant_host.c")
        .include("kernels")
        .opt_level(2)
        // the CPU dequantizers round every product: no fused multiply-adds
        .flag_if_supported("-ffp-contract=off")
        .warnings(true)
        .compile("kvrun_quant_host");

    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda_kernels(&out);
    }
}

/// The kernels' sources, sorted.
fn kernel_sources() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir("kernels")
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "cu"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVRUN_NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        let p = Path::new(&h).join("bin/nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nvcc"))
            .find(|p| p.is_file())
    })
}

fn cuda_kernels(out: &Path) {
    let require = std::env::var("KVRUN_REQUIRE_NVCC").is_ok_and(|v| v == "1");
    let fail = |msg: String| {
        if require {
            panic!("{msg}");
        }
        println!(
            "cargo:warning={msg}; the binary will have no CUDA kernels (--device cuda will say so)"
        );
    };
    let mut entries = Vec::new();
    match find_nvcc() {
        None => fail("nvcc not found (set KVRUN_NVCC or CUDA_HOME)".into()),
        Some(nvcc) => {
            for src in kernel_sources() {
                let stem = src.file_stem().unwrap().to_string_lossy().into_owned();
                let ptx = out.join(format!("{stem}.ptx"));
                let r = Command::new(&nvcc)
                    .args([
                        "-ptx",
                        "-arch=compute_80",
                        "-O3",
                        "-std=c++17",
                        "-Ikernels",
                        "-o",
                    ])
                    .arg(&ptx)
                    .arg(&src)
                    .output();
                match r {
                    Ok(o) if o.status.success() => entries.push((stem, ptx)),
                    Ok(o) => {
                        fail(format!(
                            "nvcc failed on {}: {}",
                            src.display(),
                            String::from_utf8_lossy(&o.stderr).trim()
                        ));
                        entries.clear();
                        break;
                    }
                    Err(e) => {
                        fail(format!("cannot run {}: {e}", nvcc.display()));
                        entries.clear();
                        break;
                    }
                }
            }
        }
    }
    let mut rs = String::from("/// (module name, PTX text) of every kernel file (empty: built without nvcc).\npub(super) const PTX: &[(&str, &str)] = &[\n");
    for (stem, ptx) in &entries {
        rs.push_str(&format!(
            "    ({stem:?}, include_str!({:?})),\n",
            ptx.display().to_string()
        ));
    }
    rs.push_str("];\n");
    std::fs::write(out.join("ptx.rs"), rs).expect("write ptx.rs");
}
