//! The trainer on the CPU: gradients against finite differences, the loss falling on data with
//! structure (and on Shakespeare when CI provides the texts), bitwise-repeatable runs, bad input.

use super::*;
use crate::core::tensor::Tensor;
use crate::data::format::ShardFormat;
use crate::data::pack::write_shards;
#[cfg(feature = "pack")]
use crate::data::{pack_files, PackConfig};

fn small(vocab: usize) -> ModelConfig {
    ModelConfig::gpt2("test", vocab, 32, 2, 4, 32)
}

/// A small Llama: 4 query heads over 2 key/value heads, SwiGLU of 48.
fn small_llama(vocab: usize) -> ModelConfig {
    ModelConfig::llama("test-llama", vocab, 32, 2, 4, 2, 32, 48)
}

fn tokens(b: usize, t: usize, vocab: usize, seed: u64) -> Tensor {
    let mut r = crate::core::rng::Rng::new(seed);
    let v: Vec<i32> = (0..b * (t + 1))
        .map(|_| r.below(vocab as u64) as i32)
        .collect();
    Tensor::from_vec(v, &[b, t + 1]).unwrap()
}

fn loss_of(m: &Model) -> f64 {
    m.forward(None).unwrap();
    m.loss_tensor().unwrap().to_vec::<f32>().unwrap()[0] as f64
}

/// Every parameter tensor's largest gradients against central differences of the loss. f32
/// forward passes: the step is chosen so the loss change stands well above its rounding.
fn check_gradients(cfg: &ModelConfig) {
    let (b, t) = (2, 7);
    let mut m = Model::new(cfg, DType::F32, Device::Cpu, 5, ModelOptions::default()).unwrap();
    m.prepare(b, t).unwrap();
    m.load_tokens(&tokens(b, t, cfg.vocab, 9)).unwrap();
    m.forward(Some(1.0)).unwrap();
    m.backward().unwrap();
    let grads = m.grad_buffer().to_vec::<f32>().unwrap();
    let params = m.param_buffer().clone();
    let mut worst: (f64, String) = (0.0, String::new());
    let mut checked = 0;
    for (name, off, shape) in &m.layout.layout.slots {
        let n: usize = shape.iter().product();
        // the two largest |g| of this tensor (rows ≥ T of wpe get none: skipped by the threshold)
        let mut idx: Vec<usize> = (*off..off + n).collect();
        idx.sort_by(|&a, &b| grads[b].abs().total_cmp(&grads[a].abs()));
        for &i in idx.iter().take(2).filter(|&&i| grads[i].abs() > 1e-4) {
            let h = 1e-2f32;
            let orig = params.with_cpu::<f32, _>(|p| p[i]).unwrap();
            params.with_cpu_mut::<f32, _>(|p| p[i] = orig + h).unwrap();
            let up = loss_of(&m);
            params.with_cpu_mut::<f32, _>(|p| p[i] = orig - h).unwrap();
            let down = loss_of(&m);
            params.with_cpu_mut::<f32, _>(|p| p[i] = orig).unwrap();
            let fd = (up - down) / (2.0 * h as f64);
            let g = grads[i] as f64;
            let rel = (fd - g).abs() / fd.abs().max(g.abs()).max(1e-3);
            checked += 1;
            if rel > worst.0 || rel.is_nan() {
                worst = (
                    rel,
                    format!("{name}[{}]: analytic {g:.6e}, numeric {fd:.6e}", i - off),
                );
            }
        }
    }
    let tensors = m.layout.layout.slots.len();
    assert!(
        checked >= tensors,
        "only {checked} gradients checked over {tensors} tensors"
    );
    assert!(
        worst.0 < 3e-2,
        "worst relative gradient error {:.3e} at {}",
        worst.0,
        worst.1
    );
}

#[test]
fn gpt2_gradients_match_finite_differences() {
    check_gradients(&small(61));
}

/// Llama: RMSNorm, rotary q/k (and its inverse on dq/dk), grouped-query attention, SwiGLU, the
/// untied classifier and the embedding's own gradient.
#[test]
fn llama_gradients_match_finite_differences() {
    check_gradients(&small_llama(61));
}

/// Shards of a "language" a small model can learn: each token follows from the one before it
/// (a fixed random successor table, with occasional noise).
fn structured_shards(dir: &std::path::Path, vocab: usize, tokens: usize) -> Vec<u32> {
    let mut r = crate::core::rng::Rng::new(3);
    let next: Vec<u32> = (0..vocab).map(|_| r.below(vocab as u64) as u32).collect();
    let mut x = 1u32;
    let v: Vec<u32> = (0..tokens)
        .map(|_| {
            x = if r.below(10) == 0 {
                r.below(vocab as u64) as u32
            } else {
                next[x as usize]
            };
            x
        })
        .collect();
    write_shards(
        dir,
        ShardFormat::Ferrite,
        DType::U16,
        1 << 16,
        &[v],
        vocab as u32,
    )
    .unwrap();
    next
}

fn opts(dir: &std::path::Path, model: ModelConfig, steps: usize) -> RunOptions {
    let mut o = RunOptions::new(
        dir.to_path_buf(),
        Device::Cpu,
        model,
        TrainConfig {
            batch: 4,
            seq: 32,
            steps,
            lr: 1e-2,
            warmup: 5,
            ..Default::default()
        },
    );
    o.deterministic = true;
    o.profile_step = Some(1);
    o
}

#[test]
fn loss_falls_on_structured_data_and_runs_repeat_bitwise() {
    let dir = std::env::temp_dir().join(format!("ferrite-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    structured_shards(&dir, 128, 40_000);
    let mut o = opts(&dir, small(128), 40);
    o.val_data = Some(dir.clone());
    o.train.val_every = 20;
    o.train.val_batches = 2;
    let mut lines = 0;
    let a = run(&o, &mut |l| {
        lines += 1;
        eprintln!("step {} loss {:.4} norm {:.3}", l.step, l.loss, l.grad_norm)
    })
    .unwrap();
    assert_eq!(lines, 40);
    // ln 128 = 4.85 at the start; the successor table is learnable to the noise floor (~1.2).
    assert!(a.first_loss > 4.3, "first loss {}", a.first_loss);
    assert!(
        a.last_loss < 2.5,
        "loss after 40 steps {} (first {})",
        a.last_loss,
        a.first_loss
    );
    assert!(a.last_val_loss.unwrap() < 2.5, "val {:?}", a.last_val_loss);
    assert!(a.log.iter().all(|l| l.grad_norm.is_finite() && l.lr > 0.0));
    // the profiled step names every op family it ran, each with host time
    let labels: Vec<&str> = a.profile.iter().map(|r| r.label.as_str()).collect();
    for l in [
        "embed",
        "attention",
        "attention.bwd",
        "cross_entropy",
        "embed.bwd",
        "grad norm",
    ] {
        assert!(
            labels.contains(&l),
            "{l} missing from the profile {labels:?}"
        );
    }
    assert!(a.profile.iter().all(|r| r.calls > 0 && r.host_ms >= 0.0));
    let mut od = o.clone();
    od.dump_batches = Some(dir.join("batches.i32"));
    let b = run(&od, &mut |_| {}).unwrap();
    // 40 steps × 4 rows × 33 tokens, i32
    assert_eq!(
        std::fs::metadata(dir.join("batches.i32")).unwrap().len(),
        40 * 4 * 33 * 4
    );
    let la: Vec<u64> = a.log.iter().map(|l| l.loss.to_bits()).collect();
    let lb: Vec<u64> = b.log.iter().map(|l| l.loss.to_bits()).collect();
    assert_eq!(la, lb, "two runs from one seed differ");
    // Gradient accumulation: 2 micro-batches of 2 rows see the same tokens as 1 of 4 rows
    // only in a different order, so compare the trend, not the bits.
    let mut o2 = o.clone();
    o2.train.batch = 2;
    o2.train.grad_accum = 2;
    o2.val_data = None;
    let c = run(&o2, &mut |_| {}).unwrap();
    assert!(c.last_loss < 2.5, "accumulated run: {}", c.last_loss);
    // The Llama family learns the same data.
    let mut o3 = o.clone();
    o3.model = small_llama(128);
    o3.val_data = None;
    let d = run(&o3, &mut |_| {}).unwrap();
    assert!(
        d.last_loss < 2.5,
        "llama: loss after 40 steps {} (first {})",
        d.last_loss,
        d.first_loss
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// GPT-2's tokenizer, the tiny GPT-2 and real text: the Shakespeare texts when CI provides
/// them (FERRITE_SHAKESPEARE_DIR, see .ci/run), else a short passage packed the same way.
#[test]
#[cfg(feature = "pack")]
fn tiny_gpt2_learns_text() {
    let dir = std::env::temp_dir().join(format!("ferrite-train-text-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let files: Vec<std::path::PathBuf> = match std::env::var_os("FERRITE_SHAKESPEARE_DIR") {
        Some(d) => {
            let mut f: Vec<_> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|e| e == "txt"))
                .collect();
            f.sort();
            f.truncate(6);
            f
        }
        None => {
            let p = dir.join("text.txt");
            let verse = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: \
                         Rough winds do shake the darling buds of May, And summer's lease hath all too short a date.\n";
            std::fs::write(&p, verse.repeat(200)).unwrap();
            vec![p]
        }
    };
    let shards = dir.join("shards");
    let cfg = PackConfig {
        out_dir: shards.clone(),
        ..Default::default()
    };
    pack_files(&files, &cfg, &mut |_, _, _| {}).unwrap();
    let mut o = opts(&shards, ModelConfig::preset("gpt2-tiny").unwrap(), 30);
    o.train.lr = 1e-2;
    let s = run(&o, &mut |_| {}).unwrap();
    // ln 50257 = 10.8 at the start.
    assert!(s.first_loss > 10.0, "first loss {}", s.first_loss);
    assert!(
        s.last_loss < 7.5,
        "loss after 30 steps {} (first {})",
        s.last_loss,
        s.first_loss
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_configurations_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("ferrite-train-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    structured_shards(&dir, 500, 5000);
    // T above the position table
    let mut o = opts(&dir, small(128), 2);
    o.train.seq = 33;
    let e = run(&o, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("seq") && e.contains("1..=32"), "{e}");
    // tokens ≥ the vocabulary (ids up to 499 for a model of 100)
    let o = opts(&dir, small(100), 2);
    let e = run(&o, &mut |_| {}).unwrap_err().to_string();
    assert!(
        e.contains("tokens") && e.contains("[0, 100)") && e.contains("row"),
        "{e}"
    );
    // missing data
    let o = opts(&dir.join("nope"), small(128), 2);
    assert!(run(&o, &mut |_| {}).is_err());
    // heads not dividing the dim
    let mut m = small(128);
    m.heads = 5;
    let e = run(&opts(&dir, m, 2), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("divisor of dim 32"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The bf16 GPU model against the f32 CPU model from the same initial weights and tokens: the
/// loss, every parameter tensor's gradient, and the losses of a few optimizer steps.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matches_cpu() {
    let cfg = ModelConfig::gpt2("test", 1003, 160, 2, 3, 192);
    let (b, t) = (3, 130);
    let mk = |dev, dt| {
        let mut m = Model::new(
            &cfg,
            dt,
            dev,
            11,
            ModelOptions {
                deterministic: true,
                ..Default::default()
            },
        )
        .unwrap();
        m.prepare(b, t).unwrap();
        m
    };
    let cpu = mk(Device::Cpu, DType::F32);
    let gpu = mk(Device::Cuda(0), DType::BF16);
    let hp = |step| crate::ops::adamw::AdamWHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
        grad_scale: 1.0,
    };
    for step in 0..4u64 {
        let tok = tokens(b, t, cfg.vocab, 100 + step);
        cpu.load_tokens(&tok).unwrap();
        gpu.load_tokens(&tok.to_device(Device::Cuda(0)).unwrap())
            .unwrap();
        gpu.grad_buffer().poison(None).unwrap();
        for m in [&cpu, &gpu] {
            m.forward(Some(1.0)).unwrap();
            m.backward().unwrap();
        }
        let lc = cpu.loss_tensor().unwrap().to_vec::<f32>().unwrap()[0];
        let lg = gpu.loss_tensor().unwrap().to_vec::<f32>().unwrap()[0];
        assert!(
            (lc - lg).abs() < 0.02 * lc.abs(),
            "step {step}: loss cpu {lc}, gpu {lg}"
        );
        if step == 0 {
            let gc = cpu.grad_buffer().to_f64_vec().unwrap();
            let gg = gpu.grad_buffer().to_f64_vec().unwrap();
            for (name, off, shape) in &cpu.layout.layout.slots {
                let n: usize = shape.iter().product();
                // wpe rows ≥ T get no gradient: the GPU leaves them as they were (poisoned here)
                let n = if name == "wpe" { t * cfg.dim } else { n };
                let (c, g) = (&gc[*off..off + n], &gg[*off..off + n]);
                let e = crate::core::harness::check::rel_error(g, c);
                assert!(e < 3e-2, "{name}: relative gradient error {e:.3e}");
            }
        }
        for m in [&cpu, &gpu] {
            m.optimizer_step(&hp(step + 1)).unwrap();
        }
    }
}

/// N steps straight = N/2 steps, a checkpoint, and a resumed run of the other N/2: the same
/// losses bit for bit (weights, AdamW moments, step and loader position all restored).
#[test]
fn resume_from_a_checkpoint_is_exact() {
    let dir = std::env::temp_dir().join(format!("ferrite-train-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    structured_shards(&dir, 128, 20_000);
    let mut o = opts(&dir, small(128), 6);
    o.profile_step = None;
    let straight = run(&o, &mut |_| {}).unwrap();
    let ck = dir.join("ckpt");
    let mut first = o.clone();
    first.save = Some(ck.clone());
    first.save_every = 3;
    let a = run(&first, &mut |_| {}).unwrap();
    assert_eq!(a.log.len(), 6);
    assert!(
        ck.join("step-000003/state.safetensors").exists()
            && ck.join("step-000006/model.safetensors").exists()
    );
    let meta = checkpoint::read_meta(&ck.join("step-000003")).unwrap();
    assert_eq!(meta.step, 3);
    let mut second = o.clone();
    second.resume = Some(ck.join("step-000003"));
    let b = run(&second, &mut |_| {}).unwrap();
    assert_eq!(b.log.first().unwrap().step, 3);
    let want: Vec<u64> = straight.log[3..].iter().map(|l| l.loss.to_bits()).collect();
    let got: Vec<u64> = b.log.iter().map(|l| l.loss.to_bits()).collect();
    assert_eq!(got, want, "resumed losses differ from the straight run");
    // A checkpoint of another configuration is refused with both configurations named.
    let mut other = o.clone();
    other.model.layers = 3;
    other.resume = Some(ck.join("step-000003"));
    let e = run(&other, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("layers: 3") && e.contains("layers: 2"), "{e}");
    // A corrupt state file is an error naming the file.
    let bad = ck.join("step-000006/state.safetensors");
    std::fs::write(&bad, b"not a safetensors file").unwrap();
    let mut o3 = o.clone();
    o3.resume = Some(ck.join("step-000006"));
    let e = run(&o3, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("state.safetensors"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Export to Hugging Face's GPT-2 layout and back gives the same weights; the exported tensors
/// have GPT-2's names and Conv1D ([in, out]) shapes, the vocabulary unpadded.
#[test]
fn hugging_face_export_round_trips() {
    let cfg = small(100);
    let a = Model::new(&cfg, DType::F32, Device::Cpu, 1, ModelOptions::default()).unwrap();
    let dir = std::env::temp_dir().join(format!("ferrite-train-hf-{}", std::process::id()));
    let meta = checkpoint::Meta {
        model: cfg.clone(),
        train: TrainConfig::default(),
        step: 0,
        loader: None,
        dtype: "f32".into(),
    };
    checkpoint::save(&a, &dir, &meta).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("wte.weight").unwrap().shape(), &[100, 32]);
    assert_eq!(
        st.tensor("h.1.attn.c_attn.weight").unwrap().shape(),
        &[32, 96]
    );
    assert_eq!(
        st.tensor("h.0.mlp.c_proj.weight").unwrap().shape(),
        &[128, 32]
    );
    let conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(conf["n_layer"], 2);
    assert_eq!(conf["vocab_size"], 100);
    let b = Model::new(&cfg, DType::F32, Device::Cpu, 2, ModelOptions::default()).unwrap();
    assert_ne!(
        a.param_buffer().to_vec::<f32>().unwrap(),
        b.param_buffer().to_vec::<f32>().unwrap()
    );
    checkpoint::import_hf(&b, &dir).unwrap();
    assert_eq!(
        a.param_buffer().to_vec::<f32>().unwrap(),
        b.param_buffer().to_vec::<f32>().unwrap()
    );
    // Another model size is refused, naming the tensor and both shapes.
    // Llama: q/k/v and gate/up split into Hugging Face's separate projections, and back.
    let lc = small_llama(100);
    let la = Model::new(&lc, DType::F32, Device::Cpu, 1, ModelOptions::default()).unwrap();
    let ldir = dir.with_extension("llama");
    checkpoint::save(
        &la,
        &ldir,
        &checkpoint::Meta {
            model: lc.clone(),
            ..meta.clone()
        },
    )
    .unwrap();
    let bytes = std::fs::read(ldir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        st.tensor("model.layers.1.self_attn.k_proj.weight")
            .unwrap()
            .shape(),
        &[16, 32]
    );
    assert_eq!(
        st.tensor("model.layers.0.mlp.up_proj.weight")
            .unwrap()
            .shape(),
        &[48, 32]
    );
    assert_eq!(st.tensor("lm_head.weight").unwrap().shape(), &[100, 32]);
    let lb = Model::new(&lc, DType::F32, Device::Cpu, 2, ModelOptions::default()).unwrap();
    checkpoint::import_hf(&lb, &ldir).unwrap();
    assert_eq!(
        la.param_buffer().to_vec::<f32>().unwrap(),
        lb.param_buffer().to_vec::<f32>().unwrap()
    );
    std::fs::remove_dir_all(&ldir).unwrap();
    let big = Model::new(
        &small(101),
        DType::F32,
        Device::Cpu,
        2,
        ModelOptions::default(),
    )
    .unwrap();
    let e = checkpoint::import_hf(&big, &dir).unwrap_err().to_string();
    assert!(
        e.contains("wte.weight") && e.contains("[100, 32]") && e.contains("[101, 32]"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One token at a time through the paged KV cache gives the logits the full causal forward gives
/// at every position (GPT-2: learned positions; Llama: rotary at the token's position, GQA).
#[test]
fn kv_cache_decoding_matches_the_full_forward() {
    for cfg in [small(50), small_llama(50)] {
        let n = 20;
        let toks: Vec<u32> = {
            let mut r = crate::core::rng::Rng::new(4);
            (0..=n).map(|_| r.below(50) as u32).collect()
        };
        let mut m = Model::new(&cfg, DType::F32, Device::Cpu, 3, ModelOptions::default()).unwrap();
        m.prepare(1, n).unwrap();
        let mut s = sample::Sampler::new(&m).unwrap();
        let stepwise: Vec<Vec<f32>> = toks[..n].iter().map(|&t| s.push(t).unwrap()).collect();
        let ids: Vec<i32> = toks.iter().map(|&t| t as i32).collect();
        m.load_tokens(&Tensor::from_vec(ids, &[1, n + 1]).unwrap())
            .unwrap();
        m.forward(None).unwrap();
        let full = m.logits().unwrap().to_f64_vec().unwrap();
        for (i, row) in stepwise.iter().enumerate() {
            let want = &full[i * 50..(i + 1) * 50];
            let got: Vec<f64> = row.iter().map(|&x| x as f64).collect();
            let e = crate::core::harness::check::rel_error(&got, want);
            assert!(
                e < 1e-5,
                "{:?} position {i}: relative error {e:.2e}",
                cfg.family
            );
        }
        assert!(s.push(1).is_ok() && s.len() == n + 1);
    }
}

/// A model trained on the successor-table data and reloaded from its checkpoint continues a prompt
/// the way the table does (greedy), and sampling with a seed repeats.
#[test]
fn sampling_a_trained_model_follows_its_data() {
    let dir = std::env::temp_dir().join(format!("ferrite-train-sample-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let next = structured_shards(&dir, 128, 40_000);
    let mut o = opts(&dir, small(128), 40);
    o.profile_step = None;
    o.save = Some(dir.join("ckpt"));
    run(&o, &mut |_| {}).unwrap();
    let m = sample::load(&dir.join("ckpt/step-000040"), Device::Cpu).unwrap();
    let greedy = sample::SampleOptions {
        temperature: 0.0,
        ..Default::default()
    };
    let out = sample::generate(&m, &[1, next[1]], 24, &greedy).unwrap();
    assert_eq!(out.len(), 24);
    let mut prev = next[1];
    let hits = out
        .iter()
        .filter(|&&t| {
            let ok = t == next[prev as usize];
            prev = t;
            ok
        })
        .count();
    assert!(
        hits >= 18,
        "only {hits} of 24 greedy tokens follow the table: {out:?}"
    );
    let warm = sample::SampleOptions {
        seed: 9,
        ..Default::default()
    };
    let a = sample::generate(&m, &[1], 16, &warm).unwrap();
    assert_eq!(a, sample::generate(&m, &[1], 16, &warm).unwrap());
    assert!(sample::generate(&m, &[], 4, &warm).is_err());
    assert!(sample::generate(&m, &[500], 4, &warm)
        .unwrap_err()
        .to_string()
        .contains("vocabulary"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With recompute the gradients are those of the model that keeps every activation (CPU, f32: the
/// norms recompute the same bits; GPT-2's GELU comes from the activation family's code instead
/// of the GEMM epilogue's, so within f32 rounding), in both families, and three shared buffers
/// replace 3·L per-layer ones.
#[test]
fn recompute_gives_the_same_gradients() {
    for cfg in [small(61), small_llama(61)] {
        let grads = |recompute: bool| {
            let mut m = Model::new(
                &cfg,
                DType::F32,
                Device::Cpu,
                5,
                ModelOptions {
                    recompute,
                    ..Default::default()
                },
            )
            .unwrap();
            m.prepare(2, 9).unwrap();
            m.load_tokens(&tokens(2, 9, cfg.vocab, 3)).unwrap();
            m.forward(Some(1.0)).unwrap();
            m.backward().unwrap();
            m.grad_buffer().to_f64_vec().unwrap()
        };
        let e = crate::core::harness::check::rel_error(&grads(true), &grads(false));
        assert!(
            e < 1e-6,
            "{:?}: relative gradient difference {e:.2e}",
            cfg.family
        );
    }
    let c = ModelConfig::preset("gpt2-124m").unwrap();
    let (keep, re) = (
        Model::estimate_bytes(&c, DType::BF16, 16, 1024, false, false),
        Model::estimate_bytes(&c, DType::BF16, 16, 1024, false, true),
    );
    assert!(
        keep - re > (1u64 << 30),
        "recompute saves {} bytes",
        keep - re
    );
}

/// A NaN planted in one weight is found and named: the parameter itself, and after the forward
/// the first activation it poisons.
#[test]
fn the_first_non_finite_tensor_is_named() {
    let cfg = small(61);
    let mut m = Model::new(&cfg, DType::F32, Device::Cpu, 5, ModelOptions::default()).unwrap();
    m.prepare(2, 7).unwrap();
    m.load_tokens(&tokens(2, 7, cfg.vocab, 9)).unwrap();
    m.forward(Some(1.0)).unwrap();
    assert_eq!(m.first_nonfinite().unwrap(), None);
    let (_, off, _) = m
        .layout
        .layout
        .slots
        .iter()
        .find(|s| s.0 == "h1.fc_w")
        .unwrap()
        .clone();
    m.param_buffer()
        .with_cpu_mut::<f32, _>(|p| p[off + 5] = f32::NAN)
        .unwrap();
    assert_eq!(
        m.first_nonfinite().unwrap().as_deref(),
        Some("parameter h1.fc_w")
    );
    m.forward(Some(1.0)).unwrap();
    assert!(!m.loss_tensor().unwrap().to_vec::<f32>().unwrap()[0].is_finite());
    m.param_buffer()
        .with_cpu_mut::<f32, _>(|p| p[off + 5] = 0.0)
        .unwrap();
    // the weights are finite again, the activations of that forward are not
    assert_eq!(
        m.first_nonfinite().unwrap().as_deref(),
        Some("activation h1.mlp up")
    );
}

/// Runs `o_of(rank)` as `world` data-parallel ranks (threads of this test, each its own process
/// group over TCP); every rank's result in rank order.
fn run_ranks(
    world: usize,
    o_of: impl Fn(usize) -> RunOptions + Send + Sync + 'static,
) -> Vec<Result<Summary>> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let o_of = std::sync::Arc::new(o_of);
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let o_of = o_of.clone();
            std::thread::spawn(move || {
                let env = crate::dist::DistEnv {
                    rank,
                    world,
                    local_rank: rank,
                    addr: "127.0.0.1".into(),
                    port,
                };
                let mut pg = crate::dist::ProcessGroup::with_timeout(
                    env,
                    std::time::Duration::from_secs(60),
                )?;
                run_dist(&o_of(rank), &mut pg, &mut |_| {})
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn close(a: &[f64], b: &[f64], tol: f64) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * y.abs().max(1.0))
}

/// Two ranks of B 2 are one process of B 4: the loader gives rank r rows [2r, 2r+2) of each
/// global batch of 4, the gradients are summed over the ranks, and every rank applies the same
/// update — with the optimizer state whole on each rank or sharded (ZeRO-1). A checkpoint written
/// by the ranks resumes in one process.
#[test]
fn data_parallel_equals_one_process_on_the_global_batch() {
    let dir = std::env::temp_dir().join(format!("ferrite-train-dp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    structured_shards(&dir, 128, 20_000);
    let mut one = opts(&dir, small(128), 6);
    one.profile_step = None;
    let straight = run(&one, &mut |_| {}).unwrap();
    let want: Vec<f64> = straight.log.iter().map(|l| l.loss).collect();
    let want_norm: Vec<f64> = straight.log.iter().map(|l| l.grad_norm).collect();

    // Plain data parallelism, then ZeRO-1 (optimizer state sharded over the ranks).
    for zero in [false, true] {
        let ck = dir.join(format!("ckpt-{zero}"));
        let base = one.clone();
        let ck2 = ck.clone();
        let runs = run_ranks(2, move |_| {
            let mut o = base.clone();
            o.train.batch = 2;
            o.train.steps = 3;
            o.save = Some(ck2.clone());
            o.zero = zero;
            o
        });
        let mut losses = vec![];
        for (r, s) in runs.into_iter().enumerate() {
            let s = s.unwrap_or_else(|e| panic!("rank {r} (zero {zero}): {e}"));
            assert_eq!(s.world, 2);
            let l: Vec<f64> = s.log.iter().map(|l| l.loss).collect();
            let n: Vec<f64> = s.log.iter().map(|l| l.grad_norm).collect();
            assert!(
                close(&l, &want[..3], 1e-5),
                "rank {r} zero {zero}: losses {l:?}, one process {want:?}"
            );
            assert!(
                close(&n, &want_norm[..3], 1e-4),
                "rank {r} zero {zero}: norms {n:?}, one process {want_norm:?}"
            );
            losses.push(l);
        }
        assert_eq!(
            losses[0], losses[1],
            "the ranks log different losses (zero {zero})"
        );
        // Rank 0's checkpoint, resumed by one process of B 4: the straight run's last 3 steps.
        let mut rest = one.clone();
        rest.resume = Some(ck.join("step-000003"));
        let b = run(&rest, &mut |_| {}).unwrap();
        let got: Vec<f64> = b.log.iter().map(|l| l.loss).collect();
        assert!(
            close(&got, &want[3..], 1e-5),
            "zero {zero}: resumed {got:?}, straight {:?}",
            &want[3..]
        );
    }
    // Ranks that disagree on a setting fail at start, naming the rank.
    let base = one.clone();
    let runs = run_ranks(2, move |rank| {
        let mut o = base.clone();
        if rank == 1 {
            o.train.lr *= 2.0;
        }
        o
    });
    for s in runs {
        let e = s.unwrap_err().to_string();
        assert!(
            e.contains("ranks disagree on the run's settings") && e.contains("rank 1 has"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// ZeRO-1's shards: equal, aligned, covering the buffer; a model holds one shard of the optimizer
/// state (half of it on 2 ranks) and the whole padded weights.
#[test]
fn zero_shards_cover_the_buffer_and_halve_the_optimizer_state() {
    let cfg = small(128);
    let n = model::ParamLayout::new(&cfg).len();
    for world in [2, 3, 8] {
        let shards: Vec<Shard> = (0..world).map(|r| Shard::of(n, r, world)).collect();
        assert!(shards[0].len.is_multiple_of(crate::train::arena::ALIGN));
        assert!(
            shards[0].padded() >= n && shards[0].padded() - n < world * crate::train::arena::ALIGN
        );
        for w in shards.windows(2) {
            assert_eq!(w[0].range().1, w[1].range().0);
        }
    }
    let whole = Model::new(&cfg, DType::F32, Device::Cpu, 1, ModelOptions::default()).unwrap();
    let half = Model::new(
        &cfg,
        DType::F32,
        Device::Cpu,
        1,
        ModelOptions {
            shard: Some((1, 2)),
            ..Default::default()
        },
    )
    .unwrap();
    let s = half.shard().unwrap();
    assert_eq!(half.state_buffers().1.numel(), s.len);
    assert!(2 * s.len - n < 2 * crate::train::arena::ALIGN);
    assert_eq!(whole.state_buffers().1.numel(), n);
    // the same initial weights, the shard's end padded with zeros
    let (a, b) = (
        whole.param_buffer().to_f32_vec().unwrap(),
        half.param_buffer().to_f32_vec().unwrap(),
    );
    assert_eq!(&b[..n], &a[..]);
    assert!(b[n..].iter().all(|&x| x == 0.0));
    let e = Model::new(
        &cfg,
        DType::F32,
        Device::Cpu,
        1,
        ModelOptions {
            shard: Some((2, 2)),
            ..Default::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("shard") && e.contains("world size 2"), "{e}");
}

/// Two GPUs, one rank each, against one GPU on the global batch (bf16): plain data parallelism
/// with the all-reduce overlapped with the backward inside the step's CUDA graph (steps 3 on),
/// the same with the all-reduce after the backward, and ZeRO-1. Fails on a machine with
/// fewer than two GPUs (the GPU suite skips it there).
#[test]
#[ignore = "needs two CUDA GPUs and NCCL"]
fn gpu_data_parallel_on_two_gpus() {
    let gpus = crate::core::cuda::availability().unwrap_or(0);
    // The GPU suite leaves this test out (`--skip on_two_gpus`) where fewer GPUs are visible.
    assert!(gpus >= 2, "needs two GPUs, {gpus} visible");
    let dir = std::env::temp_dir().join(format!("ferrite-train-dp-gpu-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    structured_shards(&dir, 1003, 200_000);
    let cfg = ModelConfig::gpt2("test", 1003, 128, 3, 4, 192);
    let mut one = RunOptions::new(
        dir.clone(),
        Device::Cuda(0),
        cfg,
        TrainConfig {
            batch: 8,
            seq: 128,
            steps: 6,
            lr: 3e-3,
            warmup: 2,
            ..Default::default()
        },
    );
    one.deterministic = true;
    let straight = run(&one, &mut |_| {}).unwrap();
    let want: Vec<f64> = straight.log.iter().map(|l| l.loss).collect();
    let want_norm: Vec<f64> = straight.log.iter().map(|l| l.grad_norm).collect();
    for (overlap, zero) in [(true, false), (false, false), (false, true)] {
        let base = one.clone();
        let runs = run_ranks(2, move |rank| {
            let mut o = base.clone();
            o.device = Device::Cuda(rank);
            o.train.batch = 4;
            o.overlap = overlap;
            o.zero = zero;
            o
        });
        let mut norms = vec![];
        for (r, s) in runs.into_iter().enumerate() {
            let s = s.unwrap_or_else(|e| panic!("rank {r} (overlap {overlap}, zero {zero}): {e}"));
            assert!(
                s.graph,
                "rank {r}: the step ran op by op: {:?}",
                s.graph_error
            );
            let l: Vec<f64> = s.log.iter().map(|l| l.loss).collect();
            let n: Vec<f64> = s.log.iter().map(|l| l.grad_norm).collect();
            assert!(
                close(&l, &want, 2e-2) && close(&n, &want_norm, 5e-2),
                "rank {r} (overlap {overlap}, zero {zero}): losses {l:?} norms {n:?}, one GPU {want:?} {want_norm:?}"
            );
            norms.push(n.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
        // Each rank's norm is over the summed gradient: the same bits on both.
        assert_eq!(
            norms[0], norms[1],
            "overlap {overlap}, zero {zero}: the ranks' gradients differ"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
