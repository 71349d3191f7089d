//! The small passes between op families that a training step needs (kernels/train.cu), each with
//! its CPU twin: token split, token + position embedding forward and backward, in-place add,
//! gradient accumulation and the global sum of squares. All run on the device's stream with no
//! host synchronisation (a step can be captured as a CUDA graph).

use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{CudaDevice, KernelArgs};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::{describe, Tensor};
use crate::kernel_source;
use half::bf16;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("train", "kernels/train.cu");
const OP: &str = "train";
/// Keys one `embed_sort` block sorts (FE_SORT_N): 64 KiB of shared memory.
pub const SORT_N: usize = 8192;
const THREADS: u32 = 256;
/// Blocks of `sumsq_partial` (fixed, so the summation order is too).
pub const SUMSQ_PARTS: usize = 1024;

fn program(t: DType, g: DType) -> Program {
    Program::new(SRC)
        .define("FE_T", t.cuda_name())
        .define("FE_G", g.cuda_name())
        .define("FE_SORT_N", SORT_N)
}

/// Every glue kernel with its specialisations, for the kernel build check.
pub fn kernel_specs() -> Vec<KernelSpec> {
    let all = [
        "split_tokens",
        "embed_forward",
        "embed_sort",
        "embed_backward",
        "pos_backward",
        "add_inplace",
        "accumulate",
        "sumsq_partial",
        "sumsq_final",
        "rope",
    ];
    [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::BF16, DType::F32),
    ]
    .into_iter()
    .map(|(t, g)| KernelSpec {
        program: program(t, g),
        functions: all.iter().map(|s| s.to_string()).collect(),
        min_arch: Arch::SM80,
    })
    .collect()
}

fn dev_of(t: &Tensor) -> Result<Arc<CudaDevice>> {
    t.cuda_device()
}

fn grid_for(n: usize, dev: &CudaDevice) -> u32 {
    let max = dev.props().sm_count as usize * 8;
    n.div_ceil(THREADS as usize).clamp(1, max.max(1)) as u32
}

fn expect(cond: bool, arg: &str, expected: &str, t: &Tensor) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::bad_arg(OP, arg, expected, describe(t)))
    }
}

/// Reads element `i` of a CPU float tensor as f32 (f32 or bf16 storage).
fn cpu_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_f32_vec()
}

/// `tokens` [B, T+1] i32 (rows may be strided, last dim contiguous) → inputs [B·T], targets [B·T].
pub fn split_tokens(tokens: &Tensor, inputs: &Tensor, targets: &Tensor) -> Result<()> {
    let sh = tokens.shape();
    expect(
        tokens.rank() == 2
            && sh[1] >= 2
            && tokens.dtype() == DType::I32
            && tokens.strides()[1] == 1,
        "tokens",
        "i32 [B, T+1] with T ≥ 1 and a contiguous last dim",
        tokens,
    )?;
    let (b, t) = (sh[0], sh[1] - 1);
    for (name, x) in [("inputs", inputs), ("targets", targets)] {
        expect(
            x.shape() == [b * t] && x.dtype() == DType::I32 && x.device() == tokens.device(),
            name,
            &format!("i32 [{}] on {}", b * t, tokens.device()),
            x,
        )?;
    }
    let ld = tokens.strides()[0];
    match tokens.device() {
        Device::Cpu => {
            let all = tokens.to_vec::<i32>()?;
            let mut i = Vec::with_capacity(b * t);
            let mut o = Vec::with_capacity(b * t);
            for r in 0..b {
                i.extend_from_slice(&all[r * (t + 1)..r * (t + 1) + t]);
                o.extend_from_slice(&all[r * (t + 1) + 1..(r + 1) * (t + 1)]);
            }
            inputs.with_cpu_mut::<i32, _>(|d| d[..b * t].copy_from_slice(&i))?;
            targets.with_cpu_mut::<i32, _>(|d| d[..b * t].copy_from_slice(&o))
        }
        Device::Cuda(_) => {
            let dev = dev_of(tokens)?;
            let k = dev.kernel(&program(DType::F32, DType::F32), "split_tokens")?;
            let mut a = KernelArgs::new();
            a.push(tokens.device_ptr()?)
                .push(ld as i64)
                .push(b as i32)
                .push(t as i32)
                .push(inputs.device_ptr()?)
                .push(targets.device_ptr()?);
            k.launch(
                dev.stream(),
                (grid_for(b * t, &dev), 1, 1),
                (THREADS, 1, 1),
                0,
                &mut a,
            )
        }
    }
}

fn check_table(name: &str, w: &Tensor, like: &Tensor, channels: usize) -> Result<()> {
    expect(
        w.rank() == 2
            && w.shape()[1] == channels
            && w.is_contiguous()
            && w.dtype() == like.dtype()
            && w.device() == like.device(),
        name,
        &format!(
            "a contiguous [rows, {channels}] {} table on {}",
            like.dtype(),
            like.device()
        ),
        w,
    )
}

/// out `[N, C]` = `wte[inputs] + wpe[position]` with position = i mod `seq`. A token outside
/// [0, vocab) (vocab ≤ wte's rows) gives a NaN row (the loss then says so) instead of reading out
/// of bounds.
pub fn embed_forward(
    inputs: &Tensor,
    wte: &Tensor,
    wpe: Option<&Tensor>,
    out: &Tensor,
    seq: usize,
    vocab: usize,
) -> Result<()> {
    let n = inputs.numel();
    expect(
        out.rank() == 2 && out.shape()[0] == n && out.is_contiguous() && out.dtype().is_float(),
        "out",
        &format!("a contiguous float [{n}, C]"),
        out,
    )?;
    let c = out.shape()[1];
    check_table("wte", wte, out, c)?;
    if let Some(p) = wpe {
        check_table("wpe", p, out, c)?;
        if p.shape()[0] < seq {
            return Err(Error::bad_arg(
                OP,
                "seq",
                format!("≤ the position table's {} rows", p.shape()[0]),
                seq,
            ));
        }
    }
    expect(
        inputs.rank() == 1
            && inputs.dtype() == DType::I32
            && inputs.is_contiguous()
            && seq > 0
            && n.is_multiple_of(seq),
        "inputs",
        &format!("contiguous i32 [B·{seq}]"),
        inputs,
    )?;
    if vocab > wte.shape()[0] {
        return Err(Error::bad_arg(
            OP,
            "vocab",
            format!("≤ wte's {} rows", wte.shape()[0]),
            vocab,
        ));
    }
    let v = vocab;
    match out.device() {
        Device::Cpu => {
            let ids = inputs.to_vec::<i32>()?;
            let e = cpu_f32(wte)?;
            let p = wpe.map(cpu_f32).transpose()?;
            let mut o = vec![0f32; n * c];
            for (i, &id) in ids.iter().enumerate() {
                let row = &mut o[i * c..(i + 1) * c];
                if id < 0 || id as usize >= v {
                    row.fill(f32::NAN);
                    continue;
                }
                row.copy_from_slice(&e[id as usize * c..(id as usize + 1) * c]);
                if let Some(p) = &p {
                    let t = i % seq;
                    for (x, y) in row.iter_mut().zip(&p[t * c..(t + 1) * c]) {
                        *x += y;
                    }
                }
            }
            out.write_f32(&o)
        }
        Device::Cuda(_) => {
            let dev = dev_of(out)?;
            let k = dev.kernel(&program(out.dtype(), out.dtype()), "embed_forward")?;
            let mut a = KernelArgs::new();
            a.push(inputs.device_ptr()?)
                .push(wte.device_ptr()?)
                .push(wpe.map_or(Ok(0), |p| p.device_ptr())?)
                .push(out.device_ptr()?)
                .push(seq as i32)
                .push(c as i32)
                .push(v as i32);
            k.launch(
                dev.stream(),
                (n as u32, 1, 1),
                (THREADS.min(c.next_power_of_two().max(32) as u32), 1, 1),
                0,
                &mut a,
            )
        }
    }
}

/// `dwte[inputs[i]] += dout[i]` (summed per token in position order, fp32, no atomics: the same
/// bits every run) and, when given, `dwpe[t] = Σ_b dout[b, t]` for t < seq (rows ≥ seq untouched).
/// Tokens outside [0, vocab) contribute nothing. `keys`: a u64-sized scratch of ≥ min(N, SORT_N)
/// elements as i32 pairs (`[2·SORT_N]` i32).
pub fn embed_backward(
    inputs: &Tensor,
    dout: &Tensor,
    dwte: &Tensor,
    dwpe: Option<&Tensor>,
    seq: usize,
    vocab: usize,
    keys: Option<&Tensor>,
) -> Result<()> {
    let n = inputs.numel();
    expect(
        dout.rank() == 2 && dout.shape()[0] == n && dout.is_contiguous(),
        "dout",
        &format!("a contiguous [{n}, C]"),
        dout,
    )?;
    let c = dout.shape()[1];
    check_table("dwte", dwte, dout, c)?;
    if let Some(p) = dwpe {
        check_table("dwpe", p, dout, c)?;
    }
    if vocab > dwte.shape()[0] {
        return Err(Error::bad_arg(
            OP,
            "vocab",
            format!("≤ dwte's {} rows", dwte.shape()[0]),
            vocab,
        ));
    }
    let v = vocab;
    match dout.device() {
        Device::Cpu => {
            let ids = inputs.to_vec::<i32>()?;
            let d = cpu_f32(dout)?;
            let mut e = cpu_f32(dwte)?;
            // Sum per token in fp32 first, then one add per token (as the GPU does per chunk).
            let mut order: Vec<usize> = (0..n)
                .filter(|&i| ids[i] >= 0 && (ids[i] as usize) < v)
                .collect();
            order.sort_by_key(|&i| (ids[i], i));
            let mut j = 0;
            while j < order.len() {
                let tok = ids[order[j]] as usize;
                let mut acc = vec![0f32; c];
                while j < order.len() && ids[order[j]] as usize == tok {
                    for (a, x) in acc.iter_mut().zip(&d[order[j] * c..(order[j] + 1) * c]) {
                        *a += x;
                    }
                    j += 1;
                }
                for (x, a) in e[tok * c..(tok + 1) * c].iter_mut().zip(&acc) {
                    *x += a;
                }
            }
            dwte.write_f32(&e)?;
            if let Some(p) = dwpe {
                let mut pv = cpu_f32(p)?;
                let rows = n / seq;
                for t in 0..seq {
                    for ch in 0..c {
                        pv[t * c + ch] = (0..rows).map(|b| d[(b * seq + t) * c + ch]).sum();
                    }
                }
                p.write_f32(&pv)?;
            }
            Ok(())
        }
        Device::Cuda(_) => {
            let dev = dev_of(dout)?;
            let keys = keys
                .ok_or_else(|| Error::bad_arg(OP, "keys", "a scratch tensor on the GPU", "None"))?;
            expect(
                keys.numel() * keys.dtype().size_in_bytes() >= 8 * SORT_N.min(n),
                "keys",
                &format!("≥ {} bytes of scratch", 8 * SORT_N.min(n)),
                keys,
            )?;
            let prog = program(dout.dtype(), dout.dtype());
            let sort = dev.kernel(&prog, "embed_sort")?;
            let smem = (8 * SORT_N) as u32;
            sort.allow_dynamic_smem(smem)?;
            let reduce = dev.kernel(&prog, "embed_backward")?;
            let mut start = 0;
            while start < n {
                let m = SORT_N.min(n - start);
                let mut a = KernelArgs::new();
                a.push(inputs.device_ptr()?)
                    .push(start as i64)
                    .push(m as i32)
                    .push(v as i32)
                    .push(keys.device_ptr()?);
                sort.launch(dev.stream(), (1, 1, 1), (1024, 1, 1), smem, &mut a)?;
                let mut a = KernelArgs::new();
                a.push(keys.device_ptr()?)
                    .push(m as i32)
                    .push(dout.device_ptr()?)
                    .push(dwte.device_ptr()?)
                    .push(c as i32);
                reduce.launch(dev.stream(), (m as u32, 1, 1), (THREADS, 1, 1), 0, &mut a)?;
                start += m;
            }
            if let Some(p) = dwpe {
                let k = dev.kernel(&prog, "pos_backward")?;
                let mut a = KernelArgs::new();
                a.push(dout.device_ptr()?)
                    .push(p.device_ptr()?)
                    .push((n / seq) as i32)
                    .push(seq as i32)
                    .push(c as i32);
                k.launch(dev.stream(), (seq as u32, 1, 1), (THREADS, 1, 1), 0, &mut a)?;
            }
            Ok(())
        }
    }
}

fn same(name: &str, x: &Tensor, like: &Tensor) -> Result<()> {
    expect(
        x.shape() == like.shape() && x.is_contiguous() && x.device() == like.device(),
        name,
        &format!("contiguous {:?} on {}", like.shape(), like.device()),
        x,
    )
}

/// y += x (same dtype, contiguous).
pub fn add_inplace(y: &Tensor, x: &Tensor) -> Result<()> {
    same("x", x, y)?;
    expect(
        x.dtype() == y.dtype() && y.is_contiguous(),
        "y",
        "contiguous, x's dtype",
        y,
    )?;
    match y.device() {
        Device::Cpu => {
            let xv = cpu_f32(x)?;
            let mut yv = cpu_f32(y)?;
            yv.iter_mut().zip(&xv).for_each(|(a, b)| *a += b);
            y.write_f32(&yv)
        }
        Device::Cuda(_) => {
            let dev = dev_of(y)?;
            let k = dev.kernel(&program(y.dtype(), y.dtype()), "add_inplace")?;
            let n = y.numel();
            let mut a = KernelArgs::new();
            a.push(y.device_ptr()?).push(x.device_ptr()?).push(n as i64);
            k.launch(
                dev.stream(),
                (grid_for(n, &dev), 1, 1),
                (THREADS, 1, 1),
                0,
                &mut a,
            )
        }
    }
}

/// acc (f32) = g when `first`, else acc += g.
pub fn accumulate(acc: &Tensor, g: &Tensor, first: bool) -> Result<()> {
    same("g", g, acc)?;
    expect(acc.dtype() == DType::F32, "acc", "an f32 tensor", acc)?;
    match acc.device() {
        Device::Cpu => {
            let gv = cpu_f32(g)?;
            acc.with_cpu_mut::<f32, _>(|a| {
                for (x, y) in a.iter_mut().zip(&gv) {
                    *x = if first { *y } else { *x + y };
                }
            })
        }
        Device::Cuda(_) => {
            let dev = dev_of(acc)?;
            let k = dev.kernel(&program(g.dtype(), g.dtype()), "accumulate")?;
            let n = acc.numel();
            let mut a = KernelArgs::new();
            a.push(acc.device_ptr()?)
                .push(g.device_ptr()?)
                .push(n as i64)
                .push(first as i32);
            k.launch(
                dev.stream(),
                (grid_for(n, &dev), 1, 1),
                (THREADS, 1, 1),
                0,
                &mut a,
            )
        }
    }
}

/// `out[0]` (f32) = Σ g² in a fixed order; `parts`: f32 scratch of ≥ SUMSQ_PARTS (GPU).
pub fn sumsq(g: &Tensor, parts: Option<&Tensor>, out: &Tensor) -> Result<()> {
    expect(g.is_contiguous(), "g", "a contiguous tensor", g)?;
    expect(
        out.numel() >= 1 && out.dtype() == DType::F32 && out.device() == g.device(),
        "out",
        "an f32 tensor of ≥ 1 element on g's device",
        out,
    )?;
    match g.device() {
        Device::Cpu => {
            let s: f64 = cpu_f32(g)?.iter().map(|&x| x as f64 * x as f64).sum();
            out.with_cpu_mut::<f32, _>(|o| o[0] = s as f32)
        }
        Device::Cuda(_) => {
            let dev = dev_of(g)?;
            let parts = parts
                .ok_or_else(|| Error::bad_arg(OP, "parts", "an f32 scratch on the GPU", "None"))?;
            expect(
                parts.numel() >= SUMSQ_PARTS && parts.dtype() == DType::F32,
                "parts",
                &format!("f32 with ≥ {SUMSQ_PARTS} elements"),
                parts,
            )?;
            // The element type of the parameters pairs with the gradient's in the specs.
            let t = if g.dtype() == DType::F32 {
                DType::BF16
            } else {
                g.dtype()
            };
            let prog = program(t, g.dtype());
            let k = dev.kernel(&prog, "sumsq_partial")?;
            let mut a = KernelArgs::new();
            a.push(g.device_ptr()?)
                .push(g.numel() as i64)
                .push(parts.device_ptr()?);
            k.launch(
                dev.stream(),
                (SUMSQ_PARTS as u32, 1, 1),
                (THREADS, 1, 1),
                0,
                &mut a,
            )?;
            let k = dev.kernel(&prog, "sumsq_final")?;
            let mut a = KernelArgs::new();
            a.push(parts.device_ptr()?)
                .push(SUMSQ_PARTS as i32)
                .push(out.device_ptr()?);
            k.launch(dev.stream(), (1, 1, 1), (1024, 1, 1), 0, &mut a)
        }
    }
}

/// Host f32 values → a tensor's dtype (initialisation, tests).
pub fn upload(dst: &Tensor, v: &[f32]) -> Result<()> {
    match dst.device() {
        Device::Cpu => dst.write_f32(v),
        Device::Cuda(_) => {
            let dev = dev_of(dst)?;
            let bytes: Vec<u8> = match dst.dtype() {
                DType::F32 => bytemuck::cast_slice(v).to_vec(),
                DType::BF16 => {
                    let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
                    bytemuck::cast_slice(&b).to_vec()
                }
                other => return Err(Error::bad_arg(OP, "dst", "f32 or bf16", other)),
            };
            expect(
                bytes.len() == dst.nbytes() && dst.is_contiguous(),
                "dst",
                "a contiguous tensor of v's length",
                dst,
            )?;
            // SAFETY: dst is contiguous with exactly bytes.len() bytes; synchronised below, so
            // `bytes` outlives the copy.
            unsafe { dev.htod(dst.device_ptr()?, &bytes, dev.stream())? };
            dev.synchronize(dev.stream(), "train upload")
        }
    }
}

/// Raw bytes (the tensor's own dtype, little-endian) into a contiguous tensor (checkpoints).
pub fn upload_bytes(dst: &Tensor, bytes: &[u8]) -> Result<()> {
    expect(
        bytes.len() == dst.nbytes() && dst.is_contiguous(),
        "dst",
        &format!("a contiguous tensor of {} bytes", bytes.len()),
        dst,
    )?;
    let n = dst.numel();
    match dst.device() {
        Device::Cpu => match dst.dtype() {
            DType::F32 => dst.with_cpu_mut::<f32, _>(|d| {
                bytemuck::cast_slice_mut::<f32, u8>(&mut d[..n]).copy_from_slice(bytes)
            }),
            DType::BF16 => dst.with_cpu_mut::<bf16, _>(|d| {
                bytemuck::cast_slice_mut::<bf16, u8>(&mut d[..n]).copy_from_slice(bytes)
            }),
            DType::I32 => dst.with_cpu_mut::<i32, _>(|d| {
                bytemuck::cast_slice_mut::<i32, u8>(&mut d[..n]).copy_from_slice(bytes)
            }),
            other => Err(Error::bad_arg(OP, "dst", "f32, bf16 or i32", other)),
        },
        Device::Cuda(_) => {
            let dev = dev_of(dst)?;
            // SAFETY: dst is contiguous with exactly bytes.len() bytes; synchronised below.
            unsafe { dev.htod(dst.device_ptr()?, bytes, dev.stream())? };
            dev.synchronize(dev.stream(), "train upload")
        }
    }
}

/// Rotary embeddings in place on the first `heads` heads of `head_dim` elements of each row of
/// `buf` `[N, width]` (q heads then k heads), position = `pos0` + row mod `seq`, Llama's
/// convention (element i pairs with i + head_dim/2, angle pos·θ^(−2i/head_dim)); `inverse` rotates
/// back (the gradient).
#[allow(clippy::too_many_arguments)]
pub fn rope(
    buf: &Tensor,
    seq: usize,
    pos0: usize,
    heads: usize,
    head_dim: usize,
    theta: f32,
    inverse: bool,
) -> Result<()> {
    expect(
        buf.rank() == 2
            && buf.strides()[1] == 1
            && buf.shape()[1] >= heads * head_dim
            && buf.dtype().is_float(),
        "buf",
        &format!(
            "a float [N, ≥ {}] tensor with contiguous rows",
            heads * head_dim
        ),
        buf,
    )?;
    if head_dim == 0 || !head_dim.is_multiple_of(2) || seq == 0 || theta.is_nan() || theta <= 1.0 {
        return Err(Error::bad_arg(
            OP,
            "head_dim/seq/theta",
            "an even head_dim, seq ≥ 1, θ > 1",
            format!("{head_dim}/{seq}/{theta}"),
        ));
    }
    let (n, ld, half) = (buf.shape()[0], buf.strides()[0], head_dim / 2);
    match buf.device() {
        Device::Cpu => {
            let mut v = buf.to_f32_vec()?;
            let w = buf.shape()[1];
            for r in 0..n {
                let pos = (pos0 + r % seq) as f32;
                for h in 0..heads {
                    for i in 0..half {
                        let inv = (-(2.0 * i as f32 / head_dim as f32) * theta.log2()).exp2();
                        let (mut sn, cs) = (pos * inv).sin_cos();
                        if inverse {
                            sn = -sn;
                        }
                        let base = r * w + h * head_dim;
                        let (a, b) = (v[base + i], v[base + i + half]);
                        v[base + i] = a * cs - b * sn;
                        v[base + i + half] = b * cs + a * sn;
                    }
                }
            }
            crate::core::cpu::with_f32_out(buf, |o| o.copy_from_slice(&v))
        }
        Device::Cuda(_) => {
            let dev = dev_of(buf)?;
            let k = dev.kernel(&program(buf.dtype(), buf.dtype()), "rope")?;
            let mut a = KernelArgs::new();
            a.push(buf.device_ptr()?)
                .push(ld as i64)
                .push(seq as i32)
                .push(pos0 as i64)
                .push(heads as i32)
                .push(head_dim as i32)
                .push(theta.log2())
                .push(inverse as i32);
            let threads = (heads * half)
                .next_power_of_two()
                .clamp(32, THREADS as usize) as u32;
            k.launch(dev.stream(), (n as u32, 1, 1), (threads, 1, 1), 0, &mut a)
        }
    }
}

/// Every element of a contiguous tensor set to 0.
pub fn zero(t: &Tensor) -> Result<()> {
    expect(t.is_contiguous(), "t", "a contiguous tensor", t)?;
    match t.device() {
        Device::Cpu => t.write_f32(&vec![0f32; t.numel()]),
        Device::Cuda(_) => {
            let dev = dev_of(t)?;
            // SAFETY: the view is contiguous, so its nbytes from device_ptr lie in its storage.
            unsafe { dev.memset(t.device_ptr()?, 0, t.nbytes(), dev.stream()) }
        }
    }
}
