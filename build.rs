//! With the `cuda` feature, compiles Tandem's own CUDA kernels (attention in
//! `src/model/cuda/`, sampling in `src/sampler/cuda/`) to PTX with nvcc; the
//! default build needs nothing.
//!
//! nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH; the
//! PTX targets `compute_$CUDA_COMPUTE_CAP` (default 80), which the driver
//! compiles for the GPU it runs on (that GPU or newer).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=src/model/cuda/dtype.cuh");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("CUDA_HOME")
                .map(|h| PathBuf::from(h).join("bin/nvcc"))
                .filter(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    for (dir, kernel) in [
        ("model", "attention"),
        ("model", "fused"),
        ("model", "gemv"),
        ("sampler", "sampling"),
    ] {
        let src = format!("src/{dir}/cuda/{kernel}.cu");
        println!("cargo:rerun-if-changed={src}");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(&src)
            .arg("-o")
            .arg(out.join(format!("{kernel}.ptx")))
            .status()
            .unwrap_or_else(|e| panic!("running {} for {src}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {src}");
    }
}
