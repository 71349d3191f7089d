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
    // --dtype is a ferrite-format setting: llm.c's formats fix theirs, so it is refused there.
    let (ok, _, err) = ferrite(&[
        "data",
        "pack",
        src.to_str().unwrap(),
        "-o",
        root.join("o4").to_str().unwrap(),
        "--format",
        "llmc",
        "--dtype",
        "u32",
    ]);
    assert!(
        !ok && err.contains("`--dtype`") && err.contains("the format fixes it"),
        "{err}"
    );
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

/// `bench all` as it comes: one representative case per family (forward passes only, no
/// secondary shapes), the family table, and a summary of one row per family on the device.
#[test]
fn bench_all_runs_one_representative_case_per_family() {
    let (ok, out, err) = ferrite(&["bench", "all", "--device", "cpu"]);
    assert!(ok, "{out}\n{err}");
    let families: Vec<&str> = ferrite::ops::registry().iter().map(|f| f.name()).collect();
    let (table, summary) = out.split_once("\nsummary:").expect("a summary");
    for f in &families {
        assert!(
            table.lines().any(|l| l.starts_with(&format!("{f} "))),
            "no row of {f}:\n{out}"
        );
    }
    // Secondary sections left out: attention's backward, matmul's 2048³, LayerNorm.
    for absent in [" bwd ", "2048×2048×2048", "layer_norm"] {
        assert!(
            !table.contains(absent),
            "{absent} in a representative run:\n{out}"
        );
    }
    assert!(summary.contains("--full"), "{summary}");
    let rows: Vec<&str> = summary.lines().filter(|l| l.starts_with("cpu ")).collect();
    assert_eq!(rows.len(), families.len(), "{summary}");
    for f in &families {
        assert_eq!(
            rows.iter()
                .filter(|l| l.split_whitespace().nth(1) == Some(f))
                .count(),
            1,
            "{f}: {summary}"
        );
    }
    // The CPU peer is named, with the ratio to it, and every row fits one screen.
    let matmul = rows.iter().find(|l| l.contains(" matmul ")).unwrap();
    assert!(matmul.contains("gemm-crate"), "{summary}");
    assert!(
        summary.lines().all(|l| l.chars().count() <= 140),
        "{summary}"
    );
}

/// `--full` is `bench all`'s: a single family always runs its whole bench, and `--quick` asks
/// for the opposite. (That `bench all --full` parses to the whole scope is a unit test of the
/// binary; running it would take minutes.)
#[test]
fn bench_full_is_for_all_and_not_with_quick() {
    let (ok, _, err) = ferrite(&["bench", "matmul", "--full", "--device", "cpu"]);
    assert!(
        !ok && err.contains("--full") && err.contains("`all`") && err.contains("matmul"),
        "{err}"
    );
    let (ok, _, err) = ferrite(&["bench", "all", "--full", "--quick", "--device", "cpu"]);
    assert!(
        !ok && err.contains("--full") && err.contains("--quick"),
        "{err}"
    );
}

/// A corpus the tiny model can train on: GPT-2 tokens of a repeated passage.
fn tiny_corpus(root: &std::path::Path) -> std::path::PathBuf {
    let src = root.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let text = "It is a truth universally acknowledged, that a single man in possession of a good \
                fortune, must be in want of a wife. "
        .repeat(60);
    std::fs::write(src.join("a.txt"), text).unwrap();
    let out = root.join("shards");
    let (ok, _, err) = ferrite(&[
        "data",
        "pack",
        src.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    out
}

fn losses(json: &std::path::Path) -> (usize, Vec<f64>) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let s = &v["summary"];
    let l = s["log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["loss"].as_f64().unwrap())
        .collect();
    (s["world"].as_u64().unwrap() as usize, l)
}

/// `train --nproc 2` on the CPU, plain and ZeRO-1: two processes of B 2 train as one of B 4 (the
/// same losses);
/// ranks started by hand with different settings, or a rank that never starts, are errors that
/// name the rank.
#[test]
fn train_nproc_runs_data_parallel_processes() {
    let root = std::env::temp_dir().join(format!("ferrite-cli-dp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let data = tiny_corpus(&root);
    let d = data.to_str().unwrap();
    let common = [
        "train",
        "--data",
        d,
        "--model",
        "gpt2-tiny",
        "--device",
        "cpu",
        "-t",
        "32",
        "--steps",
        "3",
    ];
    let j1 = root.join("one.json");
    let mut a: Vec<&str> = common.to_vec();
    a.extend(["-b", "4", "--json", j1.to_str().unwrap()]);
    let (ok, out, err) = ferrite(&a);
    assert!(ok, "{out}\n{err}");
    let j2 = root.join("two.json");
    let mut a: Vec<&str> = common.to_vec();
    a.extend(["-b", "2", "--nproc", "2", "--json", j2.to_str().unwrap()]);
    let (ok, out, err) = ferrite(&a);
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("on 2 ranks") && out.matches("step ").count() == 3,
        "{out}"
    );
    let j3 = root.join("zero.json");
    let mut a: Vec<&str> = common.to_vec();
    a.extend([
        "-b",
        "2",
        "--nproc",
        "2",
        "--zero",
        "--json",
        j3.to_str().unwrap(),
    ]);
    let (ok, out, err) = ferrite(&a);
    assert!(ok, "{out}\n{err}");
    assert!(err.contains("(ZeRO-1)"), "{err}");
    let (w1, l1) = losses(&j1);
    let (w2, l2) = losses(&j2);
    let (w3, l3) = losses(&j3);
    assert_eq!((w1, w2, w3), (1, 2, 2));
    assert_eq!(l1.len(), 3);
    for l in [&l2, &l3] {
        for (x, y) in l1.iter().zip(l) {
            assert!(
                (x - y).abs() < 1e-4 * x.abs(),
                "one process {l1:?}, two {l:?}"
            );
        }
    }
    let (ok, _, e) = ferrite(&["train", "--data", d, "--zero", "--device", "cpu"]);
    assert!(
        !ok && e.contains("--zero") && e.contains("several processes"),
        "{e}"
    );

    // Hand-started ranks (torchrun's variables) that disagree on the learning rate.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let rank = |r: usize, lr: &str, world: &str| {
        let mut a: Vec<&str> = common.to_vec();
        a.extend(["-b", "2", "--lr", lr]);
        Command::new(env!("CARGO_BIN_EXE_ferrite"))
            .args(&a)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", world)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("FERRITE_DIST_TIMEOUT", "20")
            .output()
            .unwrap()
    };
    let (o0, o1) = std::thread::scope(|sc| {
        let h = sc.spawn(|| rank(1, "0.001", "2"));
        (rank(0, "0.0006", "2"), h.join().unwrap())
    });
    for o in [&o0, &o1] {
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success()
                && e.contains("ranks disagree on the run's settings")
                && e.contains("rank 1 has"),
            "{e}"
        );
    }
    // Rank 0 of 3 alone: the others never join.
    let mut a: Vec<&str> = common.to_vec();
    a.extend(["-b", "2"]);
    let o = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(&a)
        .env("RANK", "0")
        .env("WORLD_SIZE", "3")
        .env("MASTER_PORT", port.to_string())
        .env("FERRITE_DIST_TIMEOUT", "1")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("ranks [1, 2] never joined"),
        "{e}"
    );
    let (ok, _, e) = ferrite(&["train", "--data", d, "--nproc", "0"]);
    assert!(!ok && e.contains("--nproc"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// `train` flags that only mean something beside another one, or out of range, are refused
/// before any work (the corpus is not even opened: it does not exist here).
#[test]
fn train_refuses_flags_it_would_ignore() {
    let base = [
        "train",
        "--data",
        "/nonexistent-corpus",
        "--device",
        "cpu",
        "--steps",
        "3",
    ];
    let cases: [(&[&str], &str); 10] = [
        (&["--val-every", "2"], "`--val-every`: expected --val-data"),
        (
            &["--val-data", "/x"],
            "`--val-data`: expected --val-every N ≥ 1",
        ),
        (
            &["--val-batches", "4"],
            "`--val-batches`: expected --val-data",
        ),
        (
            &["--val-data", "/x", "--val-every", "1", "--val-batches", "0"],
            "`--val-batches`: expected ≥ 1",
        ),
        (
            &["--save-every", "2"],
            "`--save-every`: expected --save DIR",
        ),
        (
            &["--profile-step", "0"],
            "`--profile-step`: expected a step in 1..=3",
        ),
        (
            &["--profile-step", "4"],
            "`--profile-step`: expected a step in 1..=3",
        ),
        (
            &["--no-overlap"],
            "`--no-overlap`: expected several processes",
        ),
        (&["--no-graph"], "`--no-graph`: expected a CUDA device"),
        (
            &["--svg", "/nonexistent-dir/loss.svg"],
            "`--svg`: expected a path in an existing folder",
        ),
    ];
    for (extra, want) in cases {
        let mut args: Vec<&str> = base.to_vec();
        args.extend(extra);
        let (ok, _, e) = ferrite(&args);
        assert!(!ok && e.contains(want), "{args:?}: {e}");
    }
}

/// `sample --temperature 0` is greedy: a sampling flag beside it would be ignored, so it is
/// refused (before the checkpoint is opened).
#[test]
fn sample_refuses_sampling_flags_when_greedy() {
    for flag in [["--top-k", "5"], ["--top-p", "0.5"], ["--seed", "3"]] {
        let args = [
            "sample",
            "--ckpt",
            "/nonexistent-ckpt",
            "--temperature",
            "0",
            flag[0],
            flag[1],
        ];
        let (ok, _, e) = ferrite(&args);
        assert!(
            !ok && e.contains(&format!("`{}`", flag[0])) && e.contains("greedy"),
            "{args:?}: {e}"
        );
    }
}

/// `bench moe --ep 2` on CPU ranks: the expert-parallel table; `--ep` on another family is refused.
#[test]
fn bench_moe_ep_runs_cpu_ranks() {
    let (ok, out, e) = ferrite(&["bench", "moe", "--ep", "2", "--device", "cpu"]);
    assert!(ok, "{e}");
    assert!(out.contains("speedup") && out.contains("E8 k2"), "{out}");
    let (ok, _, e) = ferrite(&["bench", "matmul", "--ep", "2", "--device", "cpu"]);
    assert!(!ok && e.contains("--ep"), "{e}");
    let (ok, _, e) = ferrite(&["bench", "moe", "--ep", "1", "--device", "cpu"]);
    assert!(!ok && e.contains("--ep"), "{e}");
    let (ok, _, e) = ferrite(&["bench", "moe", "--ep", "2", "--variant", "naive"]);
    assert!(!ok && e.contains("--variant") && e.contains("--ep"), "{e}");
}
