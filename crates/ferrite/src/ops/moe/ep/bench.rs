//! The expert-parallel layer timed on W devices (ranks as threads of this process, one per GPU,
//! NCCL between them) against the one-device layer on the same W·T tokens, and NCCL's all-to-all
//! alone at the dispatch's size: what `ferrite bench moe --ep W` prints.

use super::ExpertParallel;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use crate::dist::{Chunks, DistEnv, ProcessGroup};
use crate::ops::moe::{moe_backward, moe_forward, MoeConfig, MoeOptions, MoeWeights};
use std::time::{Duration, Instant};

/// One shape's timings (milliseconds: medians over the timed repeats; rank 0's clock).
#[derive(Clone, Debug, serde::Serialize)]
pub struct EpRecord {
    /// The layer's name (the model it is shaped after).
    pub shape: String,
    /// T… H… I… E… k….
    pub label: String,
    pub device: String,
    pub dtype: String,
    pub world: usize,
    pub tokens_per_rank: usize,
    /// The expert-parallel forward on W devices.
    pub ep_fwd_ms: f64,
    /// Its forward + backward.
    pub ep_fwd_bwd_ms: f64,
    /// The one-device layer (every expert) on all W·T tokens, forward + backward.
    pub one_device_fwd_bwd_ms: f64,
    /// one_device / ep: the speed-up of W devices over one (ideal: W).
    pub speedup: f64,
    /// NCCL's all-to-all of the dispatch's bytes (T·k rows of H, evenly over the ranks), alone.
    pub all_to_all_ms: f64,
    /// Bytes each rank sends to the other ranks per all-to-all / its time, GB/s.
    pub all_to_all_gbps: f64,
    /// The same bytes as one NCCL send/recv per expert segment (E/W per peer) instead of one per
    /// peer.
    pub all_to_all_per_segment_ms: f64,
    /// One more forward + backward with every phase waited for: per rank, (phase, ms).
    pub phases: Vec<Vec<(String, f64)>>,
}

/// The layers `bench` runs: (name, H, I, E, k, T per rank).
fn shapes(quick: bool, gpu: bool) -> Vec<(&'static str, usize, usize, usize, usize, usize)> {
    if !gpu {
        return vec![("small", 64, 48, 8, 2, 96)];
    }
    if quick {
        return vec![("qwen3-moe-small", 1024, 384, 32, 4, 2048)];
    }
    vec![
        ("mixtral-8x7b", 4096, 14336, 8, 2, 4096),
        ("qwen3-30b-a3b", 2048, 768, 128, 8, 8192),
    ]
}

/// Waits for `dev`'s work (a GPU's stream; nothing on the CPU).
fn sync(dev: Device) -> Result<()> {
    if let Device::Cuda(i) = dev {
        let d = crate::core::cuda::device(i)?;
        d.synchronize(d.stream(), "moe ep bench")?;
    }
    Ok(())
}

/// Median milliseconds of `f` over `reps` runs after `warm` (each run waited for).
fn time(dev: Device, warm: usize, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    sync(dev)?;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        sync(dev)?;
        v.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(crate::data::bench::median(&v))
}

fn free_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Error::Other(format!("moe ep bench: no free local port: {e}")))
}

/// Rank r's device: cuda:r on GPUs, the CPU otherwise.
fn device_of(gpu: bool, r: usize) -> Device {
    if gpu {
        Device::Cuda(r)
    } else {
        Device::Cpu
    }
}

/// One rank's part of a shape.
#[allow(clippy::too_many_arguments)]
fn rank_part(
    pg: &ProcessGroup,
    cfg: &MoeConfig,
    (h, i, t): (usize, usize, usize),
    dt: DType,
    dev: Device,
    reps: usize,
) -> Result<Part> {
    let ep = ExpertParallel::new(pg, cfg, h, i, dt, dev)?;
    let el = ep.experts().len();
    let r = pg.rank() as u64;
    let rand = |shape: &[usize], seed: u64, s: f64| Tensor::rand(shape, dt, dev, seed, -s, s);
    let (wscale_up, wscale_down) = (1.0 / (h as f64).sqrt(), 1.0 / (i as f64).sqrt());
    let x = rand(&[t, h], 10 + r, 1.0)?;
    let dout = rand(&[t, h], 20 + r, 1.0)?;
    let router = rand(&[cfg.experts, h], 1, 1.0 / (h as f64).sqrt())?;
    let wu = rand(&[el, h, 2 * i], 30 + r, wscale_up)?;
    let wd = rand(&[el, i, h], 40 + r, wscale_down)?;
    let w = MoeWeights {
        router: &router,
        w_up: &wu,
        w_down: &wd,
    };
    let fwd_only = MoeOptions {
        forward_only: true,
        ..Default::default()
    };
    let o = MoeOptions::default();
    let fwd = time(dev, 2, reps, || ep.forward(&x, &w, &fwd_only).map(|_| ()))?;
    let both = time(dev, 2, reps, || {
        let f = ep.forward(&x, &w, &o)?;
        ep.backward(&dout, &x, &w, &f, None, &o).map(|_| ())
    })?;
    // The dispatch's bytes alone: T·k rows of H, an equal share to every rank.
    let wn = pg.world();
    let rows = t * cfg.top_k;
    let share = rows / wn;
    let send = rand(&[share * wn, h], 50 + r, 1.0)?;
    let recv = rand(&[share * wn, h], 60 + r, 1.0)?;
    let runs: Vec<Chunks> = (0..wn).map(|d| vec![(d * share * h, share * h)]).collect();
    let a2a = time(dev, 3, reps.max(10), || {
        pg.all_to_all_v(&send, &runs, &recv, &runs)
    })?;
    let seg = share / el;
    let segs: Vec<Chunks> = (0..wn)
        .map(|d| {
            (0..el)
                .map(|j| ((d * share + j * seg) * h, seg * h))
                .collect()
        })
        .collect();
    let a2a_seg = time(dev, 3, reps.max(10), || {
        pg.all_to_all_v(&send, &segs, &recv, &segs)
    })?;
    ep.profile_phases(true);
    let f = ep.forward(&x, &w, &o)?;
    ep.backward(&dout, &x, &w, &f, None, &o)?;
    let phases = ep
        .take_phases()
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
    Ok((fwd, both, a2a, a2a_seg, phases))
}

/// A rank's timings: forward, forward + backward, all-to-all one run and one run per segment
/// (ms), and its phases.
type Part = (f64, f64, f64, f64, Vec<(String, f64)>);

/// Times every shape on `world` ranks (GPUs 0..world when `gpu`, else CPU ranks) and the
/// one-device layer on device 0.
pub fn run(world: usize, gpu: bool, quick: bool) -> Result<Vec<EpRecord>> {
    if world < 2 {
        return Err(Error::bad_arg("bench moe", "--ep", "≥ 2 ranks", world));
    }
    if gpu {
        let n = crate::core::cuda::availability().unwrap_or(0);
        if n < world {
            return Err(Error::bad_arg(
                "bench moe",
                "--ep",
                format!("≤ the {n} GPUs visible"),
                world,
            ));
        }
    }
    let dt = if gpu { DType::BF16 } else { DType::F32 };
    let reps = if quick || !gpu { 3 } else { 10 };
    let mut out = Vec::new();
    for (name, h, i, e, k, t) in shapes(quick, gpu) {
        let cfg = MoeConfig::new(e, k);
        let port = free_port()?;
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let cfg = cfg.clone();
                std::thread::spawn(move || -> Result<Part> {
                    let env = DistEnv {
                        rank: r,
                        world,
                        local_rank: r,
                        addr: "127.0.0.1".into(),
                        port,
                    };
                    let mut pg = ProcessGroup::with_timeout(env, Duration::from_secs(600))?;
                    let dev = device_of(gpu, r);
                    pg.attach(dev)?;
                    rank_part(&pg, &cfg, (h, i, t), dt, dev, reps)
                })
            })
            .collect();
        let mut parts = Vec::new();
        for (r, hnd) in handles.into_iter().enumerate() {
            let p = hnd
                .join()
                .map_err(|_| Error::Other(format!("moe ep bench: rank {r} panicked")))??;
            parts.push(p);
        }
        let (fwd, both, a2a, a2a_seg) = (parts[0].0, parts[0].1, parts[0].2, parts[0].3);
        let phases = parts.into_iter().map(|p| p.4).collect();
        // The one-device layer on every rank's tokens at once.
        let dev = device_of(gpu, 0);
        let tt = t * world;
        let rand = |shape: &[usize], seed: u64, s: f64| Tensor::rand(shape, dt, dev, seed, -s, s);
        let x = rand(&[tt, h], 11, 1.0)?;
        let dout = rand(&[tt, h], 21, 1.0)?;
        let router = rand(&[e, h], 1, 1.0 / (h as f64).sqrt())?;
        let wu = rand(&[e, h, 2 * i], 31, 1.0 / (h as f64).sqrt())?;
        let wd = rand(&[e, i, h], 41, 1.0 / (i as f64).sqrt())?;
        let w = MoeWeights {
            router: &router,
            w_up: &wu,
            w_down: &wd,
        };
        let o = MoeOptions::default();
        let one = time(dev, 2, reps, || {
            let f = moe_forward(&x, &w, &cfg, &o)?;
            moe_backward(&dout, &x, &w, &f, &cfg, &o).map(|_| ())
        })?;
        let sent = (t * k / world * world) as f64
            * h as f64
            * dt.size_in_bytes() as f64
            * (world - 1) as f64
            / world as f64;
        out.push(EpRecord {
            shape: name.into(),
            label: format!("T{t}/rank H{h} I{i} E{e} k{k}"),
            device: if gpu {
                crate::core::cuda::device(0)?.props().name.clone()
            } else {
                "cpu".into()
            },
            dtype: dt.to_string(),
            world,
            tokens_per_rank: t,
            ep_fwd_ms: fwd,
            ep_fwd_bwd_ms: both,
            one_device_fwd_bwd_ms: one,
            speedup: one / both,
            all_to_all_ms: a2a,
            all_to_all_gbps: sent / (a2a * 1e-3) / 1e9,
            all_to_all_per_segment_ms: a2a_seg,
            phases,
        });
    }
    Ok(out)
}
