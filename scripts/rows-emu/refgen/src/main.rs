//! `refgen <family> key=value ... out=DIR`: random inputs of one case and the CPU path's outputs
//! (the variant CI tests), as raw storage bytes (inputs, `*.raw`, in the case's dtype) and f32
//! (`*.f32`, outputs widened exactly), plus `meta.txt` (the scalars the kernels receive). For the
//! activation family also `keep.u8`: `core::philox::keep` per element, the mask the kernels must
//! reproduce bit for bit.

use ferrite::core::philox;
use ferrite::ops::activation::{self as act, ActOptions, Activation, Dropout, GluOptions};
use ferrite::ops::cross_entropy::{self as ce, CrossEntropyOptions, GradOut, Reduction};
use ferrite::ops::norm::{self, Bwd, BwdOut, Fwd, FwdOut, NormKind, NormOptions};
use ferrite::{DType, Device, Result, Tensor};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;

struct Args(HashMap<String, String>);

impl Args {
    fn s(&self, k: &str) -> &str {
        self.0.get(k).unwrap_or_else(|| panic!("missing {k}="))
    }
    fn n<T: std::str::FromStr>(&self, k: &str) -> T
    where
        T::Err: std::fmt::Debug,
    {
        self.s(k).parse().unwrap_or_else(|e| panic!("{k}: {e:?}"))
    }
    fn dtype(&self) -> DType {
        match self.s("dtype") {
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            o => panic!("dtype {o}"),
        }
    }
}

struct Out {
    dir: PathBuf,
    meta: String,
}

impl Out {
    fn raw(&self, name: &str, t: &Tensor) -> Result<()> {
        std::fs::write(self.dir.join(format!("{name}.raw")), t.to_bytes()?).unwrap();
        Ok(())
    }
    fn f32(&self, name: &str, t: &Tensor) -> Result<()> {
        let v = t.to_f32_vec()?;
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(self.dir.join(format!("{name}.f32")), b).unwrap();
        Ok(())
    }
    fn meta(&mut self, k: &str, v: impl std::fmt::Display) {
        writeln!(self.meta, "{k} {v}").unwrap();
    }
}

fn cpu(shape: &[usize], dtype: DType) -> Result<Tensor> {
    Tensor::empty(shape, dtype, Device::Cpu)
}

fn rand(shape: &[usize], dtype: DType, seed: u64, lo: f64, hi: f64) -> Result<Tensor> {
    Tensor::rand(shape, dtype, Device::Cpu, seed, lo, hi)
}

fn activation(a: &Args, o: &mut Out) -> Result<()> {
    let dtype = a.dtype();
    let (rows, cols): (usize, usize) = (a.n("rows"), a.n("cols"));
    let actf = Activation::parse_arg("refgen", "act", a.s("act"))?;
    let seed: u64 = a.n("seed");
    let variant = Some("parallel".to_string());
    if a.s("glu") == "1" {
        // cols = n, the output width; input [rows, 2n].
        let inp = rand(&[rows, 2 * cols], dtype, seed, -3.0, 3.0)?;
        let dout = rand(&[rows, cols], dtype, seed + 1, -1.0, 1.0)?;
        let out = cpu(&[rows, cols], dtype)?;
        let din = cpu(&[rows, 2 * cols], dtype)?;
        let opts = GluOptions {
            variant,
            stream: None,
            act: actf,
        };
        act::glu_into(&inp, &out, &opts)?;
        act::glu_backward_into(&dout, &inp, &din, &opts)?;
        o.raw("inp", &inp)?;
        o.raw("dout", &dout)?;
        o.f32("out", &out)?;
        o.f32("din", &din)?;
        return Ok(());
    }
    let p: f32 = a.n("p");
    let bias = a.s("bias") == "1";
    // x away from 0 for act = none (the mask test: a kept element is never 0).
    let x = if actf == Activation::None {
        rand(&[rows, cols], dtype, seed, 0.5, 1.5)?
    } else {
        rand(&[rows, cols], dtype, seed, -3.0, 3.0)?
    };
    let dy = rand(&[rows, cols], dtype, seed + 1, -1.0, 1.0)?;
    let b = if bias {
        Some(rand(&[cols], dtype, seed + 2, -1.0, 1.0)?)
    } else {
        None
    };
    let d = Dropout {
        p,
        seed: a.n("dseed"),
        offset: a.n("offset"),
    };
    let opts = ActOptions {
        variant,
        stream: None,
        act: actf,
        dropout: d,
    };
    let y = cpu(&[rows, cols], dtype)?;
    let dx = cpu(&[rows, cols], dtype)?;
    let db = cpu(&[cols], dtype)?;
    act::bias_act_dropout_into(&x, b.as_ref(), &y, &opts)?;
    act::bias_act_dropout_backward_into(&dy, &x, b.as_ref(), &dx, b.as_ref().map(|_| &db), &opts)?;
    o.raw("x", &x)?;
    o.raw("dy", &dy)?;
    if let Some(b) = &b {
        o.raw("b", b)?;
        o.f32("db", &db)?;
    }
    o.f32("y", &y)?;
    o.f32("dx", &dx)?;
    let (thr, scale) = d.params().unwrap_or((0, 1.0));
    o.meta("dropout", d.params().is_some() as i32);
    o.meta("thr", thr);
    o.meta("scale_bits", scale.to_bits());
    if d.params().is_some() {
        let keep: Vec<u8> = (0..(rows * cols) as u64)
            .map(|i| philox::keep(d.seed, d.offset, i, thr) as u8)
            .collect();
        std::fs::write(o.dir.join("keep.u8"), keep).unwrap();
    }
    Ok(())
}

fn norm_case(a: &Args, o: &mut Out) -> Result<()> {
    let dtype = a.dtype();
    let (rows, cols): (usize, usize) = (a.n("rows"), a.n("cols"));
    let kind = match a.s("kind") {
        "rms" => NormKind::Rms,
        "layer" => NormKind::Layer,
        k => panic!("kind {k}"),
    };
    let seed: u64 = a.n("seed");
    let eps: f32 = a.n("eps");
    let (with_w, with_b, with_res) = (a.s("w") == "1", a.s("b") == "1", a.s("res") == "1");
    let x = rand(&[rows, cols], dtype, seed, -2.0, 2.0)?;
    let res = with_res
        .then(|| rand(&[rows, cols], dtype, seed + 1, -1.0, 1.0))
        .transpose()?;
    let w = with_w
        .then(|| rand(&[cols], dtype, seed + 2, 0.5, 1.5))
        .transpose()?;
    let b = (with_b && kind == NormKind::Layer)
        .then(|| rand(&[cols], dtype, seed + 3, -0.5, 0.5))
        .transpose()?;
    let dy = rand(&[rows, cols], dtype, seed + 4, -1.0, 1.0)?;
    let y = cpu(&[rows, cols], dtype)?;
    let h = cpu(&[rows, cols], dtype)?;
    let mean = cpu(&[rows], DType::F32)?;
    let rstd = cpu(&[rows], DType::F32)?;
    let layer = kind == NormKind::Layer;
    let opts = NormOptions {
        variant: Some("parallel".into()),
        eps,
        stream: None,
    };
    norm::forward_into(
        kind,
        &Fwd {
            x: &x,
            residual: res.as_ref(),
            weight: w.as_ref(),
            bias: b.as_ref(),
        },
        &FwdOut {
            y: &y,
            h: res.as_ref().map(|_| &h),
            mean: layer.then_some(&mean),
            rstd: Some(&rstd),
        },
        &opts,
    )?;
    // The backward's input is what the forward normalised: h with a residual, else x.
    let xb = if with_res { &h } else { &x };
    let dx = cpu(&[rows, cols], dtype)?;
    let dw = cpu(&[cols], dtype)?;
    let db = cpu(&[cols], dtype)?;
    norm::backward_into(
        kind,
        &Bwd {
            dy: &dy,
            x: xb,
            weight: w.as_ref(),
            mean: layer.then_some(&mean),
            rstd: &rstd,
        },
        &BwdOut {
            dx: &dx,
            dweight: w.as_ref().map(|_| &dw),
            dbias: b.as_ref().map(|_| &db),
        },
        &opts,
    )?;
    o.raw("x", &x)?;
    o.raw("dy", &dy)?;
    o.raw("xb", xb)?;
    if let Some(t) = &res {
        o.raw("res", t)?;
        o.f32("h", &h)?;
    }
    if let Some(t) = &w {
        o.raw("w", t)?;
        o.f32("dw", &dw)?;
    }
    if let Some(t) = &b {
        o.raw("b", t)?;
        o.f32("db", &db)?;
    }
    o.f32("y", &y)?;
    if layer {
        o.f32("mean", &mean)?;
    }
    o.f32("rstd", &rstd)?;
    o.f32("dx", &dx)?;
    Ok(())
}

fn ce_case(a: &Args, o: &mut Out) -> Result<()> {
    let dtype = a.dtype();
    let (rows, v): (usize, usize) = (a.n("rows"), a.n("v"));
    let seed: u64 = a.n("seed");
    let tdt = match a.s("tgt") {
        "i64" => DType::I64,
        "i32" => DType::I32,
        t => panic!("tgt {t}"),
    };
    let logits = rand(&[rows, v], dtype, seed, -4.0, 4.0)?;
    // ninf=K: the first K logits of every row are −inf (masked classes; targets avoid them).
    let ninf: usize = a.n("ninf");
    if ninf > 0 {
        let mut lv = logits.to_f32_vec()?;
        for r in 0..rows {
            lv[r * v..][..ninf].fill(f32::NEG_INFINITY);
        }
        logits.write_f32(&lv)?;
    }
    let ignore: i64 = -100;
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let ignore_every: u64 = a.n("ignore_every");
    let tg: Vec<i64> = (0..rows)
        .map(|_| {
            if ignore_every > 0 && next() % ignore_every == 0 {
                ignore
            } else {
                (ninf as u64 + next() % (v - ninf) as u64) as i64
            }
        })
        .collect();
    let targets = match tdt {
        DType::I64 => Tensor::from_vec(tg.clone(), &[rows])?,
        _ => Tensor::from_vec(tg.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[rows])?,
    };
    let reduction = match a.s("red") {
        "mean" => Reduction::Mean,
        "sum" => Reduction::Sum,
        "none" => Reduction::None,
        r => panic!("red {r}"),
    };
    let opts = CrossEntropyOptions {
        variant: Some("parallel".into()),
        stream: None,
        ignore_index: ignore,
        label_smoothing: a.n("eps"),
        reduction,
        dloss: a.n("dloss"),
        check_targets: true,
        cluster: None,
    };
    let loss_rows = cpu(&[rows], DType::F32)?;
    let loss = cpu(&[1], DType::F32)?;
    let g = cpu(&[rows, v], dtype)?;
    ce::cross_entropy_into(
        &logits,
        &targets,
        &loss_rows,
        Some(&loss),
        GradOut::Into(&g),
        &opts,
    )?;
    o.raw("logits", &logits)?;
    o.raw("targets", &targets)?;
    o.f32("loss_rows", &loss_rows)?;
    o.f32("loss", &loss)?;
    o.f32("grad", &g)?;
    o.meta("ignore", ignore);
    Ok(())
}

fn main() -> Result<()> {
    let mut it = std::env::args().skip(1);
    let family = it.next().expect("family: act | norm | ce");
    let args = Args(
        it.map(|kv| {
            let (k, v) = kv.split_once('=').expect("key=value");
            (k.to_string(), v.to_string())
        })
        .collect(),
    );
    let dir = PathBuf::from(args.s("out"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut o = Out {
        dir,
        meta: String::new(),
    };
    match family.as_str() {
        "act" => activation(&args, &mut o)?,
        "norm" => norm_case(&args, &mut o)?,
        "ce" => ce_case(&args, &mut o)?,
        f => panic!("family {f}"),
    }
    std::fs::write(o.dir.join("meta.txt"), &o.meta).unwrap();
    Ok(())
}
