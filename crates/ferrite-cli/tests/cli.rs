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

#[test]
fn data_pack_walks_subfolders_and_names_what_it_skips() {
    let root = std::env::temp_dir().join(format!("ferrite-cli-pack-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (src, nested) = (root.join("src"), root.join("src/part2"));
    std::fs::create_dir_all(&nested).unwrap();
    std::fs::write(src.join("a.txt"), "The first document, at the top.").unwrap();
    std::fs::write(nested.join("b.txt"), "A second document, one folder down.").unwrap();
    std::fs::write(nested.join("notes.md"), "not a corpus file").unwrap();
    let out = root.join("out");
    let (ok, _, err) = ferrite(&[
        "data",
        "pack",
        src.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("skipped 1 file") && err.contains("notes.md"),
        "{err}"
    );
    // The same corpus as naming both files.
    let out2 = root.join("out2");
    let (ok, _, err) = ferrite(&[
        "data",
        "pack",
        src.join("a.txt").to_str().unwrap(),
        nested.join("b.txt").to_str().unwrap(),
        "-o",
        out2.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let tokens = |d: &std::path::Path| {
        let s = std::fs::read_to_string(d.join("index.json")).unwrap();
        let i = s.find("\"total_tokens\"").unwrap();
        s[i..].split([',', '}']).next().unwrap().to_string()
    };
    assert_eq!(tokens(&out), tokens(&out2));
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (ok, _, err) = ferrite(&[
        "data",
        "pack",
        empty.to_str().unwrap(),
        "-o",
        root.join("o3").to_str().unwrap(),
    ]);
    assert!(!ok && err.contains(".txt or .jsonl"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn bench_flags_are_checked_before_anything_runs() {
    // Each of these used to bench an empty problem, ignore the flag, or fail only at the end.
    let (ok, _, err) = ferrite(&["bench", "softmax", "--device", "cpu", "--size", "0"]);
    assert!(
        !ok && err.contains("--size") && err.contains("positive"),
        "{err}"
    );
    let (ok, _, err) = ferrite(&[
        "bench", "matmul", "--device", "cpu", "--m", "0", "--n", "8", "--k", "8",
    ]);
    assert!(
        !ok && err.contains("--m") && err.contains("positive"),
        "{err}"
    );
    for op in ["copy", "decode", "adamw"] {
        let (ok, _, err) = ferrite(&["bench", op, "--device", "cpu", "--size", "64"]);
        assert!(
            !ok && err.contains("--size") && err.contains("fixed shapes"),
            "{op}: {err}"
        );
    }
    let (ok, _, err) = ferrite(&[
        "bench", "matmul", "--device", "cpu", "--config", "c2g8", "--size", "64",
    ]);
    assert!(
        !ok && err.contains("--config") && err.contains("CUDA"),
        "{err}"
    );
    let (ok, _, err) = ferrite(&[
        "bench",
        "softmax",
        "--device",
        "cpu",
        "--size",
        "64",
        "--json",
        "/nonexistent-dir/x.json",
    ]);
    assert!(
        !ok && err.contains("--json") && err.contains("/nonexistent-dir"),
        "{err}"
    );
    let (ok, _, err) = ferrite(&[
        "check",
        "softmax",
        "--device",
        "cpu",
        "--quick",
        "--json",
        "/nonexistent-dir/x.json",
    ]);
    assert!(!ok && err.contains("--json"), "{err}");
    let (ok, _, err) = ferrite(&[
        "bench", "softmax", "--device", "cpu", "--size", "64", "--plot", "/tmp",
    ]);
    assert!(
        !ok && err.contains("--plot") && err.contains("folder"),
        "{err}"
    );
    // A filter that leaves nothing to bench (f16 matmul on the CPU) is an error, not an empty table.
    let (ok, _, err) = ferrite(&[
        "bench", "matmul", "--device", "cpu", "--dtype", "f16", "--size", "64", "--quick",
    ]);
    assert!(!ok && err.contains("no bench record"), "{err}");
}
