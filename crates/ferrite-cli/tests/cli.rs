//! The `ferrite` binary as a user runs it: exit codes, tables, JSON and SVG, and clear errors.

use std::process::Command;

fn ferrite(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(args)
        .output()
        .expect("run ferrite");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn check_quick_on_cpu_passes_and_prints_the_table() {
    let (ok, out, err) = ferrite(&["check", "all", "--quick", "--device", "cpu"]);
    assert!(ok, "{out}\n{err}");
    for col in ["variant", "shape", "error", "tol", "pass"] {
        assert!(out.contains(col), "missing column {col}:\n{out}");
    }
    for v in ["naive", "blocked", "simd", "parallel", "memcpy"] {
        assert!(out.contains(v), "missing variant {v}");
    }
    assert!(out.contains(" 0 failed"), "{out}");
}

#[test]
fn bench_writes_json_and_svg_with_the_peer_and_ratios() {
    let dir = std::env::temp_dir().join(format!("ferrite-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("b.json"), dir.join("b.svg"));
    let (ok, out, err) = ferrite(&[
        "bench",
        "matmul",
        "--device",
        "cpu",
        "--size",
        "96",
        "--quick",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("gemm-crate (peer)"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let recs = v["records"].as_array().unwrap();
    for name in ["naive", "blocked", "simd", "parallel", "gemm-crate"] {
        let r = recs
            .iter()
            .find(|r| r["variant"] == name)
            .unwrap_or_else(|| panic!("no record for {name}"));
        for field in [
            "device",
            "op",
            "variant",
            "dtype",
            "shape",
            "median_ms",
            "tflops",
            "gbps",
            "ratio_to_peer",
            "peer",
        ] {
            assert!(!r[field].is_null(), "{name}: field {field} missing: {r}");
        }
        assert!(r["median_ms"].as_f64().unwrap() > 0.0);
    }
    assert!(v["ceilings"]["cpu_core_peak_gflops"].as_f64().unwrap() > 0.0);
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.contains("parallel"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_clear_errors() {
    let (ok, _, err) = ferrite(&["check", "frobnicate"]);
    assert!(
        !ok && err.contains("frobnicate") && err.contains("matmul"),
        "{err}"
    );
    let (ok, _, err) = ferrite(&["bench", "matmul", "--dtype", "f12", "--device", "cpu"]);
    assert!(
        !ok && err.contains("--dtype") && err.contains("f12"),
        "{err}"
    );
    let (ok, _, err) = ferrite(&["check", "matmul", "--device", "tpu"]);
    assert!(!ok && err.contains("tpu"), "{err}");
    let (ok, _, err) = ferrite(&["kernels", "--arch", "sm_70"]);
    assert!(
        !ok && err.contains("sm_70") && err.contains("sm_80"),
        "{err}"
    );
    let (ok, _, err) = ferrite(&[
        "check",
        "matmul",
        "--device",
        "cpu",
        "--variant",
        "warp9",
        "--quick",
    ]);
    assert!(
        !ok && err.contains("warp9") && err.contains("matmul/simd"),
        "{err}"
    );
    // A filter that leaves nothing to check is an error, not a silent pass.
    let (ok, _, err) = ferrite(&[
        "check", "matmul", "--device", "cpu", "--dtype", "bf16", "--quick",
    ]);
    assert!(!ok && err.contains("no check case"), "{err}");
}

#[test]
fn no_gpu_is_reported_not_crashed() {
    let o = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["check", "matmul", "--device", "cuda", "--quick"])
        .env("FERRITE_DISABLE_CUDA", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("CUDA unavailable"),
        "{err}"
    );
    let o = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .arg("info")
        .env("FERRITE_DISABLE_CUDA", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("CPU variants only"),
        "{out}"
    );
}

#[test]
fn kernels_without_nvrtc_say_how_to_get_it() {
    if std::path::Path::new("/usr/local/cuda/lib64/libnvrtc.so.13").exists() {
        eprintln!("skipped: NVRTC installed system-wide");
        return;
    }
    let o = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .arg("kernels")
        .env("LD_LIBRARY_PATH", "")
        .env_remove("CUDA_HOME")
        .env_remove("CUDA_PATH")
        .env_remove("FERRITE_CUDA_LIB_DIR")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("NVRTC"), "{err}");
}

#[test]
fn data_bench_synthetic_never_writes_into_a_folder_it_did_not_create() {
    let dir = std::env::temp_dir().join(format!("ferrite-cli-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let index = dir.join("index.json");
    std::fs::write(&index, "a user's corpus index").unwrap();
    let d = dir.to_str().unwrap();
    let (ok, _, err) = ferrite(&[
        "data",
        "bench",
        d,
        "--synthetic",
        "0.001",
        "--device",
        "cpu",
    ]);
    assert!(!ok && err.contains("--force"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&index).unwrap(),
        "a user's corpus index"
    );
    let (ok, _, err) = ferrite(&["data", "bench", d, "--synthetic", "0", "--device", "cpu"]);
    assert!(!ok && err.contains("--synthetic"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
