//! plan/run: a batch's decode schedule made once per batch composition, then one launch per layer.
//!
//! A serving engine decodes the same batch through every layer of the model: the lengths change
//! once per step, the caches once per layer. [`plan_into`] (or [`DecodePlan::new`]) turns the
//! batch's `seq_lens` into a schedule on the device — the key-split work list of the pipelined
//! kernels (see kernels/decode.cu, "work of one block") — in an `i32` tensor that also holds the
//! split partials and an error flag; [`decode_planned_into`] then launches the kernels on it with
//! no host synchronisation, allocation or copy, so a step can be captured in a CUDA graph, plan
//! included. The plan reads the lengths on the device too: nothing crosses to the host.
//!
//! A plan is made for a batch shape (B, Hq, Hkv, D, dtype, device, variant); running it on another
//! is refused. The lengths may change between the plan and a run: every key is still covered (a
//! chunk's keys come from the length at run time), only the balance of the split suffers. Errors of
//! runs (a bad seq_len or block-table entry) accumulate in the plan's flag until
//! [`plan_errors`] reads it (waiting for the stream) or the next plan clears it. On the CPU a plan
//! holds nothing to schedule (the decode is checked and run on the host at once), but is still
//! made for one batch shape.

use super::{cuda, select, validate, DecodeOptions, PagedKv, Problem, MAX_CAPACITY, OP};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::{describe, Tensor};

/// What a decode plan is made for: the batch's shape. The caches and block tables may change
/// between runs (another layer), the lengths too (see the module's text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanShape {
    /// B: sequences.
    pub batch: usize,
    /// Hq: query heads.
    pub heads_q: usize,
    /// Hkv: kv heads (divides Hq).
    pub heads_kv: usize,
    /// D: the head dim.
    pub head_dim: usize,
    /// The dtype of q, o and the caches.
    pub dtype: DType,
    /// Where the plan and the decode run.
    pub device: Device,
}

impl PlanShape {
    fn of(p: &Problem) -> PlanShape {
        PlanShape {
            batch: p.batch,
            heads_q: p.heads_q,
            heads_kv: p.heads_kv,
            head_dim: p.head_dim,
            dtype: p.dtype,
            device: p.device,
        }
    }

    /// The problem a plan is made from: the cache's own sizes are not known yet, so any length
    /// in i32 range is planned (a run refuses lengths past its cache through the flag).
    fn problem(&self, opts: &DecodeOptions) -> Result<Problem> {
        let s = self;
        if s.heads_q == 0
            || s.heads_kv == 0
            || !s.heads_q.is_multiple_of(s.heads_kv)
            || s.head_dim == 0
        {
            return Err(Error::bad_arg(
                "decode_plan",
                "shape",
                "Hq ≥ 1 divisible by Hkv ≥ 1, and D ≥ 1",
                format!("Hq {}, Hkv {}, D {}", s.heads_q, s.heads_kv, s.head_dim),
            ));
        }
        if opts.window_left < -1 {
            return Err(Error::bad_arg(
                "decode_plan",
                "window_left",
                "≥ 0, or −1 for no window",
                opts.window_left,
            ));
        }
        Ok(Problem {
            batch: s.batch,
            heads_q: s.heads_q,
            heads_kv: s.heads_kv,
            head_dim: s.head_dim,
            num_blocks: 1,
            block_size: 1,
            max_blocks: MAX_CAPACITY,
            dtype: s.dtype,
            device: s.device,
            scale: 1.0,
            softcap: 0.0,
            window_left: opts.window_left,
        })
    }
}

/// Elements of the `i32` plan tensor for `shape` with these options (the variant and its split
/// setting decide whether the kernels are scheduled, and how large the schedule is).
pub fn plan_numel(shape: &PlanShape, opts: &DecodeOptions) -> Result<usize> {
    let p = shape.problem(opts)?;
    let v = select(&p, opts)?;
    match p.device {
        Device::Cpu => Ok(numel_of(None, p.batch)),
        Device::Cuda(_) => {
            let (dev, stream) = cuda::ctx(p.device, &opts.stream)?;
            let pr = cuda::prepare_with(v, &p, &dev, &stream, opts.num_splits, false)?;
            Ok(numel_of(Some(&pr), p.batch))
        }
    }
}

/// The plan elements a preparation needs: its schedule, or (unscheduled variants, the CPU) the
/// header with its flag and an indptr's worth that only ties the plan to the batch size.
fn numel_of(pr: Option<&cuda::Prepared>, batch: usize) -> usize {
    pr.and_then(|pr| pr.sched.as_ref())
        .map_or(cuda::SCHED_HEADER + batch + 1, |sc| sc.layout.bytes / 4)
}

fn check_plan_tensor(plan: &Tensor, shape: &PlanShape, opts: &DecodeOptions) -> Result<()> {
    check_plan_numel(plan, shape, plan_numel(shape, opts)?)
}

fn check_plan_numel(plan: &Tensor, shape: &PlanShape, want: usize) -> Result<()> {
    if plan.dtype() != DType::I32
        || plan.device() != shape.device
        || !plan.is_contiguous()
        || plan.numel() != want
    {
        return Err(Error::bad_arg(
            OP,
            "plan",
            format!(
                "the i32 [{want}] tensor on {} that decode_plan made for B {}, Hq {}, Hkv {}, D {}, {} (plan again for another batch shape or variant)",
                shape.device, shape.batch, shape.heads_q, shape.heads_kv, shape.head_dim, shape.dtype
            ),
            describe(plan),
        ));
    }
    Ok(())
}

/// Plans the batch whose lengths are `seq_lens` (`[B]` i32 on the plan's device) into `plan`
/// (`plan_numel` i32 elements): clears its error flag and queues the planning kernel. On the
/// CPU the lengths are checked when the decode runs.
pub fn plan_into(
    seq_lens: &Tensor,
    plan: &Tensor,
    shape: &PlanShape,
    opts: &DecodeOptions,
) -> Result<()> {
    if seq_lens.dtype() != DType::I32
        || seq_lens.shape() != [shape.batch]
        || seq_lens.device() != shape.device
        || !seq_lens.is_contiguous()
    {
        return Err(Error::bad_arg(
            "decode_plan",
            "seq_lens",
            format!(
                "a contiguous i32 [{}] tensor on {}",
                shape.batch, shape.device
            ),
            describe(seq_lens),
        ));
    }
    let p = shape.problem(opts)?;
    if p.device == Device::Cpu {
        return check_plan_tensor(plan, shape, opts);
    }
    let v = select(&p, opts)?;
    let (dev, stream) = cuda::ctx(p.device, &opts.stream)?;
    let pr = cuda::prepare_with(v, &p, &dev, &stream, opts.num_splits, false)?;
    check_plan_numel(plan, shape, numel_of(Some(&pr), p.batch))?;
    if p.batch == 0 {
        return Ok(());
    }
    let buf = plan.device_ptr()?;
    if pr.sched.is_none() {
        // Unscheduled variants keep only the flag here.
        // SAFETY: the plan tensor holds at least SCHED_HEADER i32s (checked above).
        return unsafe { dev.memset(buf, 0, cuda::SCHED_HEADER * 4, &stream) };
    }
    pr.plan(&p, seq_lens.device_ptr()?, buf, &stream)
}

/// Decode attention into `o` (and `lse`) on a plan made for this batch shape: launches only
/// (the GPU check of seq_lens and block-table entries goes to the plan's flag; read it with
/// [`plan_errors`]). On the CPU this is [`super::decode_into`] (checked on the host).
pub fn decode_planned_into(
    q: &Tensor,
    kv: &PagedKv,
    o: &Tensor,
    lse: Option<&Tensor>,
    plan: &Tensor,
    opts: &DecodeOptions,
) -> Result<()> {
    let p = validate(q, kv, o, lse, opts)?;
    let v = select(&p, opts)?;
    let shape = PlanShape::of(&p);
    match p.device {
        Device::Cpu => {
            check_plan_tensor(plan, &shape, opts)?;
            if p.batch == 0 {
                return Ok(());
            }
            super::cpu::decode(v, &p, q, kv, o, lse)
        }
        Device::Cuda(_) => {
            // One preparation (kernels, launch shape, schedule layout) serves the plan's check
            // and the launch: the host path of a layer's run stays short.
            let (dev, stream) = cuda::ctx(p.device, &opts.stream)?;
            let pr = cuda::prepare_with(v, &p, &dev, &stream, opts.num_splits, false)?;
            check_plan_numel(plan, &shape, numel_of(Some(&pr), p.batch))?;
            if p.batch == 0 {
                return Ok(());
            }
            cuda::launch_planned(v, &pr, &p, q, kv, o, lse, plan.device_ptr()?, &stream)
        }
    }
}

/// Waits for the plan's stream and reports the errors its runs flagged since it was planned
/// (then clears the flag). Ok on the CPU, where every run checks on the host.
pub fn plan_errors(plan: &Tensor, opts: &DecodeOptions) -> Result<()> {
    if plan.dtype() != DType::I32 || plan.numel() < cuda::SCHED_HEADER || !plan.is_contiguous() {
        return Err(Error::bad_arg(
            "decode_plan_errors",
            "plan",
            "a plan tensor made by decode_plan",
            describe(plan),
        ));
    }
    if plan.device() == Device::Cpu {
        return Ok(());
    }
    let (dev, stream) = cuda::ctx(plan.device(), &opts.stream)?;
    let flag = plan.device_ptr()? + (cuda::S_ERR * 4) as u64;
    let r = cuda::read_flag(&dev, flag, &stream, OP);
    // SAFETY: the flag is 4 live bytes of the plan tensor.
    unsafe { dev.memset(flag, 0, 4, &stream)? };
    r
}

/// A batch's decode schedule with its shape: [`plan_into`], [`decode_planned_into`] and
/// [`plan_errors`] on an owned plan tensor.
#[derive(Debug)]
pub struct DecodePlan {
    plan: Tensor,
    shape: PlanShape,
}

impl DecodePlan {
    /// Allocates the plan tensor for `shape` and plans `seq_lens` into it.
    pub fn new(seq_lens: &Tensor, shape: PlanShape, opts: &DecodeOptions) -> Result<DecodePlan> {
        let plan = Tensor::empty(&[plan_numel(&shape, opts)?], DType::I32, shape.device)?;
        plan_into(seq_lens, &plan, &shape, opts)?;
        Ok(DecodePlan { plan, shape })
    }

    /// Plans new lengths (the next step) into the same tensor.
    pub fn replan(&self, seq_lens: &Tensor, opts: &DecodeOptions) -> Result<()> {
        plan_into(seq_lens, &self.plan, &self.shape, opts)
    }

    /// One layer's decode on this plan ([`decode_planned_into`]).
    pub fn run(
        &self,
        q: &Tensor,
        kv: &PagedKv,
        o: &Tensor,
        lse: Option<&Tensor>,
        opts: &DecodeOptions,
    ) -> Result<()> {
        decode_planned_into(q, kv, o, lse, &self.plan, opts)
    }

    /// The errors the runs flagged ([`plan_errors`]).
    pub fn errors(&self, opts: &DecodeOptions) -> Result<()> {
        plan_errors(&self.plan, opts)
    }

    /// The plan tensor (for callers that pass it on, e.g. into a CUDA graph).
    pub fn tensor(&self) -> &Tensor {
        &self.plan
    }

    /// The batch shape the plan was made for.
    pub fn shape(&self) -> PlanShape {
        self.shape
    }
}
