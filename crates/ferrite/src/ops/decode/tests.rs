//! decode tests: the check harness on every device present, features on small hand-checkable
//! inputs, and bad input.

use super::check::{make_inputs, Case, UNUSED_ENTRY};
use super::*;

#[test]
fn every_variant_passes_check() {
    // CPU: 2 variants × 3 dtypes × cases × (direct, planned) + 5 refusals each; append: 3 dtypes
    // × 3 records.
    let recs = crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * 3 * 2 * check::cases(true).len() + 2 * 5 + 3 * 3,
    );
    assert!(recs.iter().any(|r| r.shape.ends_with(" planned") && r.pass));
    assert!(recs.iter().any(|r| r.variant == "append_kv" && r.pass));
}

fn small(lens: &[i32], window: i64, softcap: f32) -> Case {
    Case {
        hq: 4,
        hkv: 2,
        d: 8,
        block_size: 4,
        lens: lens.to_vec(),
        softcap,
        window,
        scale: None,
    }
}

fn run(c: &Case, x: &check::Inputs, variant: &str) -> Result<(Vec<f32>, Vec<f32>)> {
    let (o, lse) = decode(&x.q, &x.kv(), &check::options(variant, c))?;
    Ok((o.to_vec::<f32>()?, lse.to_vec::<f32>()?))
}

#[test]
fn empty_sequence_gives_zero_and_neg_inf_lse() {
    let c = small(&[0, 5], -1, 0.0);
    let x = make_inputs(&c, DType::F32, Device::Cpu, 3, 1).unwrap();
    for v in ["naive", "parallel"] {
        let (o, lse) = run(&c, &x, v).unwrap();
        assert!(o[..4 * 8].iter().all(|&x| x == 0.0), "{v}: {o:?}");
        assert!(lse[..4].iter().all(|&x| x == f32::NEG_INFINITY), "{v}");
        assert!(lse[4..].iter().all(|x| x.is_finite()), "{v}");
    }
}

#[test]
fn length_one_returns_the_value_row_and_window_zero_sees_only_the_last_key() {
    // One visible key: softmax weight 1, o = v of that key (for each query head's kv head).
    for (lens, window) in [(vec![1], -1), (vec![11], 0)] {
        let c = small(&lens, window, 0.0);
        let x = make_inputs(&c, DType::F32, Device::Cpu, 5, 0).unwrap();
        let j = (lens[0] - 1) as usize;
        let blk = x.table[j / 4] as usize;
        let v = x.value_cache.to_vec::<f32>().unwrap();
        for var in ["naive", "parallel"] {
            let (o, _) = run(&c, &x, var).unwrap();
            for h in 0..4 {
                let kvh = h / 2;
                let want = &v[((blk * 4 + j % 4) * 2 + kvh) * 8..][..8];
                for (a, b) in o[h * 8..][..8].iter().zip(want) {
                    assert!(
                        (a - b).abs() < 1e-6,
                        "{var} lens {lens:?} head {h}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn softcap_bounds_the_logits() {
    // With softcap c every score lies in (−c, c), so lse ≤ c + ln(len).
    let c = Case {
        scale: Some(10.0),
        ..small(&[30], -1, 0.5)
    };
    let x = make_inputs(&c, DType::F32, Device::Cpu, 9, 0).unwrap();
    let (_, lse) = run(&c, &x, "parallel").unwrap();
    assert!(lse.iter().all(|&l| l <= 0.5 + 30f32.ln() + 1e-4), "{lse:?}");
    let (_, lse_uncapped) = run(
        &Case {
            softcap: 0.0,
            ..c.clone()
        },
        &x,
        "parallel",
    )
    .unwrap();
    assert!(
        lse_uncapped.iter().any(|&l| l > 0.5 + 30f32.ln()),
        "{lse_uncapped:?}"
    );
}

fn expect_err(r: Result<impl std::fmt::Debug>, needles: &[&str]) {
    let e = r.unwrap_err().to_string();
    for n in needles {
        assert!(e.contains(n), "`{n}` not in: {e}");
    }
}

#[test]
fn bad_input_is_refused() {
    let c = small(&[9, 4], -1, 0.0);
    let x = make_inputs(&c, DType::F32, Device::Cpu, 1, 1).unwrap();
    let opts = DecodeOptions::default();
    // Head counts: 3 query heads over 2 kv heads.
    let q3 = Tensor::rand(&[2, 3, 8], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    expect_err(
        decode(&q3, &x.kv(), &opts),
        &["`q`", "divisible", "3 query heads"],
    );
    // Head dim mismatch.
    let q16 = Tensor::rand(&[2, 4, 16], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    expect_err(decode(&q16, &x.kv(), &opts), &["`key_cache`", "D = 16"]);
    // dtype mismatch between q and the caches.
    let qb = Tensor::rand(&[2, 4, 8], DType::BF16, Device::Cpu, 1, -1.0, 1.0).unwrap();
    expect_err(decode(&qb, &x.kv(), &opts), &["`key_cache`", "bf16"]);
    // Block-table entry out of range for a visible key.
    let mut t = x.table.clone();
    t[0] = x.num_blocks as i32;
    let bt = Tensor::from_vec(t, &[2, x.max_blocks]).unwrap();
    let kv = PagedKv {
        block_table: &bt,
        ..x.kv()
    };
    expect_err(
        decode(&x.q, &kv, &opts),
        &["`block_table`", "block_table[0, 0]"],
    );
    // seq_len beyond the table's reach, and negative.
    for bad in [(x.max_blocks * 4) as i32 + 1, -1] {
        let sl = Tensor::from_vec(vec![9, bad], &[2]).unwrap();
        let kv = PagedKv {
            seq_lens: &sl,
            ..x.kv()
        };
        expect_err(decode(&x.q, &kv, &opts), &["`seq_lens`", "seq_lens[1]"]);
    }
    // i32 index tensors only.
    let slf = Tensor::from_vec(vec![9.0f32, 4.0], &[2]).unwrap();
    let kv = PagedKv {
        seq_lens: &slf,
        ..x.kv()
    };
    expect_err(decode(&x.q, &kv, &opts), &["`seq_lens`", "i32"]);
    // Options.
    let w = DecodeOptions {
        window_left: -2,
        ..Default::default()
    };
    expect_err(decode(&x.q, &x.kv(), &w), &["`window_left`"]);
    let s = DecodeOptions {
        softcap: -1.0,
        ..Default::default()
    };
    expect_err(decode(&x.q, &x.kv(), &s), &["`softcap`"]);
    // Output aliasing q.
    expect_err(
        decode_into(&x.q, &x.kv(), &x.q, None, &opts),
        &["`o`", "distinct"],
    );
    // A GPU-only variant on the CPU.
    let g = DecodeOptions {
        variant: Some("gqa".into()),
        ..Default::default()
    };
    expect_err(decode(&x.q, &x.kv(), &g), &["gqa"]);
}

#[test]
fn unused_and_out_of_window_entries_are_not_read() {
    // A window of 2 over 11 keys in blocks of 4: block 0 (keys 0..4) is out of the window and
    // holds UNUSED_ENTRY, which would be refused if read.
    let c = small(&[11], 2, 0.0);
    let x = make_inputs(&c, DType::F32, Device::Cpu, 2, 0).unwrap();
    assert_eq!(x.table[0], UNUSED_ENTRY);
    for v in ["naive", "parallel"] {
        run(&c, &x, v).unwrap();
    }
    // Without the window the same table is refused.
    let c2 = Case { window: -1, ..c };
    expect_err(run(&c2, &x, "parallel"), &["`block_table`", "-7"]);
}

#[test]
fn append_kv_copies_and_refuses_bad_slots() {
    let kc = Tensor::full(&[3, 2, 1, 4], DType::F32, Device::Cpu, 7.0).unwrap();
    let vc = kc.deep_copy().unwrap();
    let k = Tensor::from_vec((0..8).map(|x| x as f32).collect(), &[2, 1, 4]).unwrap();
    let v = Tensor::from_vec((10..18).map(|x| x as f32).collect(), &[2, 1, 4]).unwrap();
    let sm = Tensor::from_vec(vec![5i32, -1], &[2]).unwrap();
    append_kv(&k, &v, &kc, &vc, &sm, &AppendOptions::default()).unwrap();
    let kcv = kc.to_vec::<f32>().unwrap();
    assert_eq!(&kcv[20..24], &[0., 1., 2., 3.]);
    assert!(kcv[..20].iter().all(|&x| x == 7.0));
    assert_eq!(&vc.to_vec::<f32>().unwrap()[20..24], &[10., 11., 12., 13.]);
    for bad in [6i32, -2] {
        let sm = Tensor::from_vec(vec![0, bad], &[2]).unwrap();
        expect_err(
            append_kv(&k, &v, &kc, &vc, &sm, &AppendOptions::default()),
            &["`slot_mapping`", "slot_mapping[1]"],
        );
    }
    let kb = Tensor::rand(&[2, 1, 4], DType::BF16, Device::Cpu, 1, -1.0, 1.0).unwrap();
    expect_err(
        append_kv(&kb, &v, &kc, &vc, &sm, &AppendOptions::default()),
        &["`k`"],
    );
    let k5 = Tensor::rand(&[2, 1, 5], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    expect_err(
        append_kv(&k5, &v, &kc, &vc, &sm, &AppendOptions::default()),
        &["`k`", "[2, 1, 4]"],
    );
}

#[test]
fn device_error_flag_decodes_to_named_errors() {
    assert!(device_error(OP, 0).is_ok());
    let e = device_error(OP, ERR_BLOCK).unwrap_err().to_string();
    assert!(e.contains("`block_table`") && e.contains("skipped"), "{e}");
    let e = device_error(OP, ERR_SEQ_LEN).unwrap_err().to_string();
    assert!(e.contains("`seq_lens`"), "{e}");
    let e = device_error(APPEND_OP, ERR_SLOT).unwrap_err().to_string();
    assert!(
        e.contains("`slot_mapping`") && e.contains("append_kv"),
        "{e}"
    );
    let e = device_error(OP, ERR_BLOCK | ERR_SEQ_LEN)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("seq_len") && e.contains("block_table entry"),
        "{e}"
    );
}

#[test]
fn gpu_variant_constraints_and_split_planning() {
    let p = Problem {
        batch: 16,
        heads_q: 32,
        heads_kv: 8,
        head_dim: 128,
        num_blocks: 4096,
        block_size: 16,
        max_blocks: 256,
        dtype: DType::BF16,
        device: Device::Cpu,
        scale: 1.0,
        softcap: 0.0,
        window_left: -1,
    };
    assert_eq!(cuda::heads_per_block(4), 4);
    assert_eq!(cuda::heads_per_block(12), 6);
    assert_eq!(cuda::heads_per_block(32), 8);
    assert_eq!(cuda::heads_per_block(7), 7);
    // 128 base blocks on 132 SMs: 4 partitions (512 blocks, one wave at 4 per SM).
    assert_eq!(cuda::auto_splits(&p, 132), 4);
    // One sequence at 32k: 8 base blocks → 66 partitions of ~497 keys.
    let long = Problem {
        batch: 1,
        max_blocks: 2048,
        ..p
    };
    assert_eq!(cuda::auto_splits(&long, 132), 66);
    // Many sequences: no split; short windows: no split.
    assert_eq!(cuda::auto_splits(&Problem { batch: 256, ..p }, 132), 1);
    assert_eq!(
        cuda::auto_splits(
            &Problem {
                window_left: 100,
                ..p
            },
            132
        ),
        1
    );
    assert!(unfit("split_kv", &Problem { batch: 256, ..p }, 132, None, true).is_some());
    assert!(unfit("split_kv", &Problem { batch: 256, ..p }, 132, None, false).is_none());
    // Partitions cover the context.
    let (size, parts) = cuda::partitions(&p, 5);
    assert!(size * parts >= 4096 && size * (parts - 1) < 4096);
    let e = unfit("gqa", &Problem { head_dim: 100, ..p }, 132, None, true).unwrap();
    assert!(e.contains("multiples of 8"), "{e}");
    assert!(unfit("naive", &Problem { head_dim: 100, ..p }, 132, None, true).is_none());
    assert!(unfit("naive", &Problem { head_dim: 320, ..p }, 132, None, true).is_some());
    // Every launched specialisation family is listed for the build check.
    let specs = cuda::kernel_specs();
    for f in [
        "decode_naive",
        "decode_gqa",
        "decode_reduce",
        "decode_pipelined",
        "decode_mma",
        "decode_merge",
        "append_kv",
    ] {
        assert!(
            specs.iter().any(|s| s.functions.iter().any(|x| x == f)),
            "{f}"
        );
    }
}

#[test]
fn pipelined_geometry_and_split_plan() {
    // Tiles of ~1024 elements (2 KiB of K in 16-bit), at least one key per key group.
    for (d, tk) in [(8, 32), (16, 32), (64, 16), (96, 8), (128, 8), (256, 4)] {
        assert_eq!(cuda::pipe_tile_keys(d), tk, "D{d}");
    }
    // D128, 4 heads: rings 4 warps × 3 stages × (K + V) × 8 keys × 128 × 2 B = 48 KiB, plus
    // 4 × 68 floats of score scratch (the 8 KiB warp-merge buffer reuses the rings).
    assert_eq!(cuda::pipe_smem_bytes(128, 4), 49152 + 4 * 68 * 4);
    // D256, 8 heads: the merge buffer (4 × 8 × 258 floats) still fits in the rings.
    assert_eq!(cuda::pipe_smem_bytes(256, 8), 49152 + 4 * (2 * 32 + 8) * 4);
    // Every specialisation: the launch-bound blocks fit an sm_90 SM's 228 KiB (1 KiB reserved per
    // block), and at least 2 blocks fit an sm_80 SM's 164 KiB.
    for d in (8..=256).step_by(8) {
        for g in 1..=8 {
            let per_block = cuda::pipe_smem_bytes(d, g) + 1024;
            let per_sm = cuda::pipe_min_blocks(g);
            assert!(
                per_sm * per_block <= 228 * 1024,
                "D{d} G{g}: {per_block} × {per_sm}"
            );
            assert!(2 * per_block <= 164 * 1024, "D{d} G{g}: {per_block} × 2");
        }
    }
    // The shapes on 132 SMs × 4 resident blocks (bs16 tables hold one spare block, so
    // max_visible = ctx + 16): B16 → 4 partitions (512 blocks, one wave); B64 → none (512);
    // B1 ctx32k → 60 (480 blocks ≥ 90% of the 528 slots).
    assert_eq!(cuda::plan_splits(16 * 8, 4096 + 16, 528), 4);
    assert_eq!(cuda::plan_splits(64 * 8, 2048 + 16, 528), 1);
    assert_eq!(cuda::plan_splits(8, 32768 + 16, 528), 60);
    // A wave and a sliver: split until the last wave is (nearly) full.
    let s = cuda::plan_splits(600, 4096, 528);
    let blocks = 600 * s;
    assert!(s > 1 && blocks % 528 >= 476, "{s} splits: {blocks} blocks");
    // Short contexts cap the splits (≥ PIPE_MIN_PART_KEYS keys each); degenerate inputs give 1.
    assert_eq!(cuda::plan_splits(8, 300, 528), 2);
    assert_eq!(cuda::plan_splits(8, 0, 528), 1);
    assert_eq!(cuda::plan_splits(0, 4096, 0), 1);
    // The mma kernel: 2 warps × 3 stages × (K + V) × 16 keys × (D + 8) × 2 B.
    assert_eq!(cuda::mma_smem_bytes(128, 4), 2 * 3 * 2 * 16 * 136 * 2);
    for d in (16..=256).step_by(16) {
        for g in 1..=8 {
            let per_block = cuda::mma_smem_bytes(d, g) + 1024;
            assert!(
                2 * per_block <= 228 * 1024,
                "mma D{d} G{g}: {per_block} × 2"
            );
        }
    }
    let p = Problem {
        batch: 2,
        heads_q: 8,
        heads_kv: 2,
        head_dim: 72,
        num_blocks: 64,
        block_size: 16,
        max_blocks: 8,
        dtype: DType::BF16,
        device: Device::Cpu,
        scale: 1.0,
        softcap: 0.0,
        window_left: -1,
    };
    // D 72: not a multiple of 16 → the mma rung declines (the default falls back to pipelined).
    let e = unfit("pipelined_mma", &p, 132, None, true).unwrap();
    assert!(e.contains("multiples of 16"), "{e}");
    assert!(unfit("pipelined", &p, 132, None, true).is_none());
    assert!(unfit(
        "pipelined_mma",
        &Problem { head_dim: 80, ..p },
        132,
        None,
        true
    )
    .is_none());
    let e = device_error(OP, ERR_LAUNCH).unwrap_err().to_string();
    assert!(
        e.contains("shared memory") && !e.contains("`seq_lens`"),
        "{e}"
    );
}

#[test]
fn schedule_layout_holds_header_indptr_items_and_aligned_partials() {
    // B 32 on 528 slots, 8 units per chunk: 32 chunks + one wave (66) of extra chunks.
    let l = cuda::sched_layout(32, 32, 128, 8, 528);
    assert_eq!(l.max_items, 32 + 66);
    let ints = cuda::SCHED_HEADER + 33 + 2 * l.max_items;
    assert!(
        l.part_offset >= 4 * ints
            && l.part_offset.is_multiple_of(16)
            && l.part_offset < 4 * ints + 16
    );
    assert_eq!(l.bytes, l.part_offset + l.max_items * 32 * 130 * 4);
    // A batch that alone fills the device still gets at least one chunk per sequence.
    assert!(cuda::sched_layout(4096, 8, 64, 8, 528).max_items >= 4096);
}

#[test]
fn plan_and_run_on_the_cpu_equal_decode_and_are_made_for_one_batch() {
    let c = small(&[0, 37, 5, 19], 6, 0.0);
    let x = make_inputs(&c, DType::F32, Device::Cpu, 11, 2).unwrap();
    let opts = check::options("parallel", &c);
    let (o_ref, lse_ref) = decode(&x.q, &x.kv(), &opts).unwrap();
    let shape = check::plan_shape(&c, DType::F32, Device::Cpu);
    let plan = DecodePlan::new(&x.seq_lens, shape, &opts).unwrap();
    let (o, lse) = (
        Tensor::empty(&[4, 4, 8], DType::F32, Device::Cpu).unwrap(),
        Tensor::empty(&[4, 4], DType::F32, Device::Cpu).unwrap(),
    );
    o.poison(None).unwrap();
    plan.run(&x.q, &x.kv(), &o, Some(&lse), &opts).unwrap();
    plan.errors(&opts).unwrap();
    assert_eq!(o.to_vec::<f32>().unwrap(), o_ref.to_vec::<f32>().unwrap());
    assert_eq!(
        lse.to_vec::<f32>().unwrap(),
        lse_ref.to_vec::<f32>().unwrap()
    );
    // A plan for 3 sequences on this batch of 4, or a tensor that is not a plan: named errors.
    let three = Tensor::from_vec(vec![1i32, 2, 3], &[3]).unwrap();
    let other = DecodePlan::new(&three, PlanShape { batch: 3, ..shape }, &opts).unwrap();
    expect_err(
        other.run(&x.q, &x.kv(), &o, Some(&lse), &opts),
        &["`plan`", "B 4"],
    );
    let f32_plan = Tensor::empty(&[plan.tensor().numel()], DType::F32, Device::Cpu).unwrap();
    expect_err(
        decode_planned_into(&x.q, &x.kv(), &o, Some(&lse), &f32_plan, &opts),
        &["`plan`", "i32"],
    );
    // Lengths of the wrong shape or dtype for the plan.
    expect_err(plan.replan(&three, &opts), &["`seq_lens`", "[4]"]);
    expect_err(
        DecodePlan::new(
            &x.seq_lens,
            PlanShape {
                heads_kv: 3,
                ..shape
            },
            &opts,
        ),
        &["`shape`", "divisible"],
    );
}

/// A ragged batch for the GPU tests: GQA 4, D128, pages of 16.
#[cfg(test)]
fn ragged(lens: &[i32]) -> Case {
    Case {
        hq: 16,
        hkv: 4,
        d: 128,
        block_size: 16,
        lens: lens.to_vec(),
        softcap: 0.0,
        window: -1,
        scale: None,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_plan_serves_every_layer_and_stale_lengths_and_collects_errors() {
    let dev = Device::Cuda(0);
    let lens: Vec<i32> = (0..24)
        .map(|i| [3000, 17, 0, 5000, 700, 1, 2600, 260][i % 8])
        .collect();
    let c = ragged(&lens);
    let opts = check::options("pipelined", &c);
    let shape = check::plan_shape(&c, DType::BF16, dev);
    // Two layers: other caches and queries, the same lengths and block table.
    let layers: Vec<_> = (0..2)
        .map(|l| make_inputs(&c, DType::BF16, dev, 100 + l, 2).unwrap())
        .collect();
    let plan = DecodePlan::new(&layers[0].seq_lens, shape, &opts).unwrap();
    for x in &layers {
        let (want, want_lse) = decode(&x.q, &x.kv(), &opts).unwrap();
        let o = Tensor::empty(&[24, 16, 128], DType::BF16, dev).unwrap();
        let lse = Tensor::empty(&[24, 16], DType::F32, dev).unwrap();
        o.poison(None).unwrap();
        plan.run(&x.q, &x.kv(), &o, Some(&lse), &opts).unwrap();
        plan.errors(&opts).unwrap();
        // Same kernels, same chunks, same merge order: bit-identical to the one-call path.
        assert_eq!(o.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
        assert_eq!(
            lse.to_vec::<f32>().unwrap(),
            want_lse.to_vec::<f32>().unwrap()
        );
        // The uniform partitions of the same kernel agree to rounding.
        let uni = DecodeOptions {
            num_splits: Some(5),
            ..opts.clone()
        };
        let (u, _) = decode(&x.q, &x.kv(), &uni).unwrap();
        let e = crate::core::harness::check::rel_error(
            &u.to_f64_vec().unwrap(),
            &want.to_f64_vec().unwrap(),
        );
        assert!(e < 1e-2, "scheduled vs uniform: {e}");
    }
    // Planned for other lengths: every key still counted.
    let x = &layers[1];
    let other: Vec<i32> = lens.iter().map(|l| l / 3).collect();
    let other = Tensor::from_vec(other, &[24])
        .unwrap()
        .to_device(dev)
        .unwrap();
    plan.replan(&other, &opts).unwrap();
    let o = Tensor::empty(&[24, 16, 128], DType::BF16, dev).unwrap();
    plan.run(&x.q, &x.kv(), &o, None, &opts).unwrap();
    plan.errors(&opts).unwrap();
    let (want, _) = decode(&x.q, &x.kv(), &opts).unwrap();
    let e = crate::core::harness::check::rel_error(
        &o.to_f64_vec().unwrap(),
        &want.to_f64_vec().unwrap(),
    );
    assert!(e < 1e-2, "stale plan: {e}");
    // A bad block-table entry in one layer: flagged, reported once by errors(), then cleared.
    let mut table = x.table.clone();
    table[3 * x.max_blocks] = x.num_blocks as i32;
    let bad = Tensor::from_vec(table, &[24, x.max_blocks])
        .unwrap()
        .to_device(dev)
        .unwrap();
    let kv = PagedKv {
        block_table: &bad,
        ..x.kv()
    };
    plan.run(&x.q, &kv, &o, None, &opts).unwrap();
    expect_err(plan.errors(&opts), &["`block_table`"]);
    plan.errors(&opts).unwrap();
}
