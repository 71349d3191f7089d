//! Timing: warm-up, repeats, median/min/max. CPU work is timed with the host clock; GPU work with
//! CUDA events around each repeat, inputs rotated by the caller so the working set exceeds L2.

use crate::core::cuda::{CudaDevice, GpuTimer, Stream};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use std::time::{Duration, Instant};

/// Summary of timed repeats.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Stats {
    /// Median time of one repeat, ms.
    pub median_ms: f64,
    /// Fastest repeat, ms.
    pub min_ms: f64,
    /// Slowest repeat, ms.
    pub max_ms: f64,
    /// Repeats timed.
    pub reps: usize,
}

impl Stats {
    /// Median, min and max of `ms` (all zero when empty).
    pub fn from_samples(mut ms: Vec<f64>) -> Stats {
        ms.sort_by(|a, b| a.total_cmp(b));
        let n = ms.len();
        if n == 0 {
            return Stats::default();
        }
        let median = if n % 2 == 1 {
            ms[n / 2]
        } else {
            0.5 * (ms[n / 2 - 1] + ms[n / 2])
        };
        Stats {
            median_ms: median,
            min_ms: ms[0],
            max_ms: ms[n - 1],
            reps: n,
        }
    }
}

/// How long and how often to measure.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Untimed runs first (compilation, tuning, caches, clocks).
    pub warmup: usize,
    /// Repeats timed at least.
    pub min_reps: usize,
    /// Repeats timed at most.
    pub max_reps: usize,
    /// Stop adding repeats once this much time was measured (after `min_reps`).
    pub target: Duration,
}

impl Budget {
    /// CPU work: few repeats of long runs.
    pub fn cpu() -> Self {
        Budget {
            warmup: 1,
            min_reps: 3,
            max_reps: 50,
            target: Duration::from_millis(1500),
        }
    }
    /// GPU work: many repeats of short kernels.
    pub fn gpu() -> Self {
        Budget {
            warmup: 5,
            min_reps: 20,
            max_reps: 200,
            target: Duration::from_millis(800),
        }
    }
}

/// Times `f` on the CPU.
pub fn time_cpu(budget: Budget, mut f: impl FnMut()) -> Stats {
    for _ in 0..budget.warmup {
        f();
    }
    let mut samples = Vec::new();
    let started = Instant::now();
    while samples.len() < budget.max_reps
        && (samples.len() < budget.min_reps || started.elapsed() < budget.target)
    {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Stats::from_samples(samples)
}

/// Times an op that can fail on the CPU: the first error stops the measurement and is returned.
pub fn time_cpu_op(budget: Budget, mut f: impl FnMut() -> Result<()>) -> Result<Stats> {
    let mut err = None;
    let stats = time_cpu(budget, || {
        if err.is_none() {
            err = f().err();
        }
    });
    err.map_or(Ok(stats), Err)
}

/// The `config` column of a CPU record: how many threads the variant used.
pub fn cpu_threads_note(parallel: bool) -> String {
    if parallel {
        format!("{} threads", rayon::current_num_threads())
    } else {
        "1 thread".into()
    }
}

/// Times `f(rep)` on `stream` with an event pair per repeat; `rep` lets the caller rotate inputs.
/// Repeats are queued in batches and read back after each batch, so host gaps don't count.
pub fn time_gpu(
    dev: &CudaDevice,
    stream: &Stream,
    budget: Budget,
    f: impl FnMut(usize) -> Result<()>,
) -> Result<Stats> {
    Ok(Stats::from_samples(time_gpu_samples(
        dev, stream, budget, f,
    )?))
}

/// Rounds a bench gives `time_gpu_alternating`: enough that each closure is timed both before
/// and after the others.
pub const ALTERNATING_ROUNDS: usize = 3;

/// Times several launches under the same clock history: `rounds` rounds, each timing every
/// closure in turn with a `rounds`-th of the budget, the samples pooled per closure. A peer
/// timed once after ours runs under a different GPU clock and power state than ours did (the
/// H100 drifts by ~10 % over the first second of load), which biases the ratio either way.
pub fn time_gpu_alternating(
    dev: &CudaDevice,
    stream: &Stream,
    budget: Budget,
    rounds: usize,
    fs: &mut [&mut dyn FnMut(usize) -> Result<()>],
) -> Result<Vec<Stats>> {
    let rounds = rounds.max(1);
    let per_round = Budget {
        warmup: budget.warmup,
        min_reps: budget.min_reps.div_ceil(rounds).max(1),
        max_reps: budget.max_reps.div_ceil(rounds).max(1),
        target: budget.target / rounds as u32,
    };
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); fs.len()];
    for _ in 0..rounds {
        for (k, f) in fs.iter_mut().enumerate() {
            samples[k].extend(time_gpu_samples(dev, stream, per_round, &mut **f)?);
        }
    }
    Ok(samples.into_iter().map(Stats::from_samples).collect())
}

/// Times several launches of similar length one repeat at a time: every cycle runs each closure
/// once, in a fresh shuffled order, so all of them share the GPU's clock and power history down
/// to a few milliseconds and none always follows the same neighbour. Block rounds
/// (`time_gpu_alternating`) left ~270 ms between a peer's samples and ours: on the H100 at its
/// 700 W limit, the same two GEMMs' ratio to cuBLAS's then moved by 0.926–0.997 between calls
/// of one binary (bench/results/2026-11-26-h100-linear-bench-timing-last-tile/dact-group-height).
/// Cycles: enough to spend the budget's target per closure, within its repeat bounds.
pub fn time_gpu_interleaved(
    dev: &CudaDevice,
    stream: &Stream,
    budget: Budget,
    fs: &mut [&mut dyn FnMut(usize) -> Result<()>],
) -> Result<Vec<Stats>> {
    let n = fs.len();
    for f in fs.iter_mut() {
        for i in 0..budget.warmup {
            f(i)?;
        }
    }
    dev.synchronize(stream, "warm-up")?;
    // One probe cycle sizes the run.
    let cycle_ms = time_once(dev, stream, || fs.iter_mut().try_for_each(|f| f(0)))?;
    let cycles = ((n as f64 * budget.target.as_secs_f64() * 1e3 / cycle_ms) as usize)
        .clamp(budget.min_reps, budget.max_reps);
    let timers: Vec<GpuTimer> = (0..cycles * n)
        .map(|_| GpuTimer::new(dev))
        .collect::<Result<_>>()?;
    let mut slot = vec![0usize; cycles * n];
    for c in 0..cycles {
        for (j, k) in interleave_order(c, n).into_iter().enumerate() {
            let t = &timers[c * n + j];
            t.start(stream)?;
            fs[k](c + 1)?;
            t.stop(stream)?;
            slot[c * n + j] = k;
        }
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(cycles); n];
    for (t, &k) in timers.iter().zip(&slot) {
        samples[k].push(t.elapsed_ms()?);
    }
    Ok(samples.into_iter().map(Stats::from_samples).collect())
}

/// Times several launches each at its own steady state: per round, each closure runs back to back
/// for `settle` (untimed: at the H100's 700 W limit the clock takes a second or so to find the
/// level the launch's power draw holds), then for `measure` with an event pair per repeat;
/// `rounds` rounds, the samples pooled per closure. Slower than `time_gpu_interleaved`, it
/// charges a launch that draws more power per FLOP with the lower clock it earns.
pub fn time_gpu_sustained(
    dev: &CudaDevice,
    stream: &Stream,
    settle: Duration,
    measure: Duration,
    rounds: usize,
    fs: &mut [&mut dyn FnMut(usize) -> Result<()>],
) -> Result<Vec<Stats>> {
    let mut ones = Vec::with_capacity(fs.len());
    for f in fs.iter_mut() {
        f(0)?;
        dev.synchronize(stream, "sustained-timing probe")?;
        ones.push(time_once(dev, stream, || f(0))?);
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); fs.len()];
    for _ in 0..rounds.max(1) {
        for (k, f) in fs.iter_mut().enumerate() {
            let reps = |d: Duration| (d.as_secs_f64() * 1e3 / ones[k]).ceil() as usize;
            let budget = Budget {
                warmup: reps(settle).max(1),
                min_reps: reps(measure).max(5),
                max_reps: reps(measure).max(5),
                target: measure,
            };
            samples[k].extend(time_gpu_samples(dev, stream, budget, &mut **f)?);
        }
    }
    Ok(samples.into_iter().map(Stats::from_samples).collect())
}

/// The order of cycle `cycle`'s `n` closures in `time_gpu_interleaved`: a permutation of 0..n
/// drawn from a fixed-seed generator (the same orders on every run).
pub fn interleave_order(cycle: usize, n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    // splitmix64 of the cycle: independent orders per cycle without a stored generator.
    let mut x = (cycle as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// `time_gpu_alternating` over boxed closures (a bench's list of launches of different types).
pub fn time_gpu_alternating_boxed(
    dev: &CudaDevice,
    stream: &Stream,
    budget: Budget,
    rounds: usize,
    fs: &mut [Box<dyn FnMut(usize) -> Result<()> + '_>],
) -> Result<Vec<Stats>> {
    let mut refs: Vec<&mut dyn FnMut(usize) -> Result<()>> =
        fs.iter_mut().map(|f| f.as_mut() as _).collect();
    time_gpu_alternating(dev, stream, budget, rounds, &mut refs)
}

/// Milliseconds of one call of `f` on `stream` (an event pair around it; at least 1e-4, so a
/// probe can divide by it): how the timers size their runs.
fn time_once(dev: &CudaDevice, stream: &Stream, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let probe = GpuTimer::new(dev)?;
    probe.start(stream)?;
    f()?;
    probe.stop(stream)?;
    Ok(probe.elapsed_ms()?.max(1e-4))
}

/// The per-repeat times (ms) of `time_gpu`.
fn time_gpu_samples(
    dev: &CudaDevice,
    stream: &Stream,
    budget: Budget,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<f64>> {
    for i in 0..budget.warmup {
        f(i)?;
    }
    dev.synchronize(stream, "warm-up")?;
    // One probe repeat to size the batches.
    let one = time_once(dev, stream, || f(0))?;
    let wanted = ((budget.target.as_secs_f64() * 1e3 / one) as usize)
        .clamp(budget.min_reps, budget.max_reps);
    let timers: Vec<GpuTimer> = (0..wanted)
        .map(|_| GpuTimer::new(dev))
        .collect::<Result<_>>()?;
    for (i, t) in timers.iter().enumerate() {
        t.start(stream)?;
        f(i + 1)?;
        t.stop(stream)?;
    }
    timers.iter().map(|t| t.elapsed_ms()).collect()
}

/// How many input sets to rotate through so one pass over them exceeds the L2 (×2 for margin),
/// capped so the sets fit comfortably in `free_bytes`.
pub fn rotation_sets(bytes_per_set: usize, l2_bytes: u64, free_bytes: u64) -> usize {
    if bytes_per_set == 0 {
        return 1;
    }
    let want = ((2 * l2_bytes) as usize).div_ceil(bytes_per_set).max(1);
    let cap = ((free_bytes / 4) as usize / bytes_per_set).max(1);
    want.min(cap).min(64)
}

/// One line of a bench report. `ratio_to_peer` > 1 means faster than the peer.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BenchRecord {
    /// The device and its name (`cuda:0 (NVIDIA H100 80GB HBM3)`).
    pub device: String,
    /// The family.
    pub op: String,
    /// The variant or peer timed.
    pub variant: String,
    /// The input dtype.
    pub dtype: String,
    /// The case, in the family's words.
    pub shape: String,
    /// Median time of one call, ms.
    pub median_ms: f64,
    /// Fastest call, ms.
    pub min_ms: f64,
    /// Slowest call, ms.
    pub max_ms: f64,
    /// Calls timed.
    pub reps: usize,
    /// Floating-point operations of one call (the op's nominal count).
    pub flops: f64,
    /// Bytes one call must move at least (inputs read once, outputs written once).
    pub bytes: f64,
    /// `flops` at the median time, TFLOP/s.
    pub tflops: f64,
    /// `bytes` at the median time, GB/s.
    pub gbps: f64,
    /// Percent of the relevant ceiling (vendor rate for compute-bound, copy bandwidth otherwise).
    pub pct_of_ceiling: Option<f64>,
    /// Which ceiling `pct_of_ceiling` is against.
    pub ceiling: String,
    /// The baseline's median over this one's (> 1: faster than the baseline).
    pub speedup_vs_baseline: Option<f64>,
    /// The variant the speedup is over (the ladder's first rung on this device).
    pub baseline: String,
    /// The peer's median over this one's (> 1: faster than the vendor library).
    pub ratio_to_peer: Option<f64>,
    /// The peer the ratio is against.
    pub peer: String,
    /// This record times the peer itself.
    pub is_peer: bool,
    /// Registers per thread of the main kernel (GPU).
    pub registers: Option<i32>,
    /// Shared memory per block of the main kernel, static plus dynamic, bytes.
    pub smem_bytes: Option<u32>,
    /// Local memory per thread of the main kernel (spills), bytes.
    pub spill_bytes: Option<i32>,
    /// Theoretical occupancy of the main kernel, 0..1.
    pub occupancy: Option<f64>,
    /// The launch configuration or thread count that ran.
    pub config: String,
    /// Anything special about the case.
    pub note: String,
    /// Peak device memory one call needed (inputs, outputs and workspaces), from the
    /// stream-ordered pool's high-water mark; ops that measure it set it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes: Option<u64>,
}

impl BenchRecord {
    /// A record of `stats` for one case, with the rates derived from `flops` and `bytes`.
    pub fn new(
        device: Device,
        device_name: &str,
        op: &str,
        variant: &str,
        dtype: DType,
        shape: String,
        stats: Stats,
        flops: f64,
        bytes: f64,
    ) -> Self {
        let s = stats.median_ms * 1e-3;
        BenchRecord {
            device: format!("{device} ({device_name})"),
            op: op.into(),
            variant: variant.into(),
            dtype: dtype.to_string(),
            shape,
            median_ms: stats.median_ms,
            min_ms: stats.min_ms,
            max_ms: stats.max_ms,
            reps: stats.reps,
            flops,
            bytes,
            tflops: if s > 0.0 { flops / s / 1e12 } else { 0.0 },
            gbps: if s > 0.0 { bytes / s / 1e9 } else { 0.0 },
            ..Default::default()
        }
    }
}

impl BenchRecord {
    /// Adds the kernel's resource columns (registers, shared memory, local bytes, occupancy).
    pub fn with_kernel(
        mut self,
        kernel: &crate::core::cuda::Kernel,
        block_threads: u32,
        dyn_smem: u32,
    ) -> Result<Self> {
        let res = kernel.resources()?;
        self.registers = Some(res.registers);
        self.smem_bytes = Some(res.static_smem as u32 + dyn_smem);
        self.spill_bytes = Some(res.local_bytes);
        self.occupancy = Some(kernel.occupancy(block_threads, dyn_smem)?);
        Ok(self)
    }
}

/// Fills the relative columns of a group of records measured together (same op, shape, dtype,
/// device): speedup over `baseline`, ratio to the record flagged `is_peer`, percent of `ceiling`.
pub fn relate(records: &mut [BenchRecord], baseline: &str, ceiling: Option<(&str, f64, bool)>) {
    let base = records
        .iter()
        .find(|r| r.variant == baseline)
        .map(|r| (r.median_ms, r.variant.clone()));
    let peer = records
        .iter()
        .find(|r| r.is_peer)
        .map(|r| (r.median_ms, r.variant.clone()));
    for r in records.iter_mut() {
        if let Some((b, name)) = &base {
            r.speedup_vs_baseline = Some(b / r.median_ms);
            r.baseline = name.clone();
        }
        if let Some((p, name)) = &peer {
            r.ratio_to_peer = Some(p / r.median_ms);
            r.peer = name.clone();
        }
        if let Some((name, value, compute_bound)) = ceiling {
            let achieved = if compute_bound {
                r.tflops * 1e3
            } else {
                r.gbps
            };
            if value > 0.0 {
                r.pct_of_ceiling = Some(100.0 * achieved / value);
                r.ceiling = name.to_string();
            }
        }
    }
}

/// The CPU's name for reports.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleave_orders_are_fixed_varied_permutations() {
        let n = 8;
        let mut firsts = std::collections::BTreeSet::new();
        // Which closure ran right before closure 0, over the cycles.
        let mut before0 = std::collections::BTreeSet::new();
        for c in 0..200 {
            let o = interleave_order(c, n);
            assert_eq!(o, interleave_order(c, n), "cycle {c}: not reproducible");
            let mut sorted = o.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "cycle {c}: {o:?}");
            firsts.insert(o[0]);
            if let Some(p) = o.iter().position(|&k| k == 0).filter(|&p| p > 0) {
                before0.insert(o[p - 1]);
            }
        }
        assert_eq!(firsts.len(), n, "every closure leads some cycle");
        assert_eq!(
            before0.len(),
            n - 1,
            "closure 0 follows every other closure"
        );
        assert_eq!(interleave_order(3, 1), vec![0]);
        use crate::core::harness::Timing;
        assert_eq!("sustained".parse::<Timing>().unwrap(), Timing::Sustained);
        assert_eq!(
            "interleaved".parse::<Timing>().unwrap(),
            Timing::Interleaved
        );
        let e = "blocks".parse::<Timing>().unwrap_err().to_string();
        assert!(e.contains("--timing") && e.contains("blocks"), "{e}");
        assert!(interleave_order(3, 0).is_empty());
    }

    #[test]
    fn stats_and_relations() {
        let s = Stats::from_samples(vec![3.0, 1.0, 2.0, 10.0]);
        assert_eq!(
            (s.median_ms, s.min_ms, s.max_ms, s.reps),
            (2.5, 1.0, 10.0, 4)
        );
        let mk = |v: &str, ms: f64, peer: bool| BenchRecord {
            variant: v.into(),
            median_ms: ms,
            is_peer: peer,
            tflops: 1.0 / ms,
            ..Default::default()
        };
        let mut rs = vec![
            mk("naive", 10.0, false),
            mk("fast", 2.0, false),
            mk("vendor", 1.0, true),
        ];
        relate(&mut rs, "naive", Some(("peak", 1000.0, true)));
        assert_eq!(rs[1].speedup_vs_baseline, Some(5.0));
        assert_eq!(rs[1].ratio_to_peer, Some(0.5));
        assert_eq!(rs[2].pct_of_ceiling, Some(100.0));
        assert_eq!(rotation_sets(10 << 20, 50 << 20, 80 << 30), 10);
        assert_eq!(rotation_sets(1 << 30, 50 << 20, 80 << 30), 1);
    }
}
