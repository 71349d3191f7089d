//! The check and bench harness: what an op family implements to take part in `ferrite check`,
//! `ferrite bench` and `ferrite kernels`, and the shared machinery they use. Knows no op.

// Timing, reference comparison and the tables/JSON/SVG of `ferrite check` and `ferrite bench`:
// pub for the op families' check.rs/bench.rs and the CLI, not an interface for library users.
#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod check;
#[doc(hidden)]
pub mod report;

use crate::core::cuda::jit::Program;
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::variant::VariantInfo;
pub use bench::{cpu_name, BenchRecord, Budget, Stats};
pub use check::{CheckConfig, CheckRecord, Precision};

/// What `ferrite bench` runs.
#[derive(Clone, Debug, Default)]
pub struct BenchConfig {
    /// Devices to run on (the CPU, GPUs).
    pub devices: Vec<Device>,
    /// Only these variants (all when empty).
    pub variants: Vec<String>,
    /// Only these dtypes (each family's defaults when empty).
    pub dtypes: Vec<DType>,
    /// Explicit problem shapes (op-specific meaning, e.g. [m, n, k]); the op's defaults when empty.
    pub shapes: Vec<Vec<usize>>,
    /// Fewer, smaller cases (CI, smoke runs).
    pub quick: bool,
    /// Launch configurations to time by name, each as its own row, for variants that have them
    /// (matmul `wgmma`: `c2g8`, `c2g8d`, ...); the tuned one when empty.
    pub configs: Vec<String>,
    /// How benches that compare launches against a peer time them (those that take it: linear).
    pub timing: Timing,
    /// Run the family's sweep of shapes instead of its ladder (matmul: `--sweep`, the default
    /// path against the vendor libraries over a grid of M × (N, K)).
    pub sweep: bool,
    /// One representative case per family: its headline shape, every variant of its ladder and
    /// its peer, without the secondary sections (further shapes, dtypes, passes, kinds and
    /// sub-benches); `bench all` without `--full`. Explicit `shapes` and `dtypes` still win.
    pub representative: bool,
}

/// How a bench times a group of launches it compares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Timing {
    /// Repeat by repeat in shuffled order (`bench::time_gpu_interleaved`): every launch under
    /// the same clock and power history, as in a training step that mixes them.
    #[default]
    Interleaved,
    /// Each launch back to back for seconds, settled first, in alternating rounds
    /// (`bench::time_gpu_sustained`): every launch at the clock its own power draw holds.
    Sustained,
}

impl std::str::FromStr for Timing {
    type Err = crate::core::error::Error;
    /// `interleaved` or `sustained` (the bench's `--timing`).
    fn from_str(s: &str) -> Result<Timing, Self::Err> {
        match s {
            "interleaved" => Ok(Timing::Interleaved),
            "sustained" => Ok(Timing::Sustained),
            _ => Err(crate::core::error::Error::bad_arg(
                "bench",
                "--timing",
                "interleaved or sustained",
                s,
            )),
        }
    }
}

impl BenchConfig {
    /// Whether the variant (or peer) called `name` is selected.
    pub fn wants_variant(&self, name: &str) -> bool {
        self.variants.is_empty() || self.variants.iter().any(|v| v == name)
    }
    /// Whether `d` is selected.
    pub fn wants_dtype(&self, d: DType) -> bool {
        self.dtypes.is_empty() || self.dtypes.contains(&d)
    }
    /// A family's default cases (shapes, passes, kinds), headline first: all of them, or in
    /// representative scope the headline alone.
    pub fn scope<'a, T>(&self, cases: &'a [T]) -> &'a [T] {
        if self.representative {
            &cases[..cases.len().min(1)]
        } else {
            cases
        }
    }
    /// The dtypes a bench runs out of its defaults `all` (headline first): those asked for, else
    /// `all` in the current scope (the first alone in representative scope).
    pub fn dtypes_in_scope(&self, all: &[DType]) -> Vec<DType> {
        if self.dtypes.is_empty() {
            self.scope(all).to_vec()
        } else {
            all.iter()
                .copied()
                .filter(|d| self.wants_dtype(*d))
                .collect()
        }
    }
    /// The requested GEMM-like shapes as [m, n, k] (a single number means a cube, two mean
    /// [m, n, n]), or `defaults`.
    pub fn shapes_3d(&self, defaults: &[[usize; 3]]) -> Vec<[usize; 3]> {
        if self.shapes.is_empty() {
            return defaults.to_vec();
        }
        self.shapes
            .iter()
            .filter_map(|s| match s[..] {
                [n] => Some([n, n, n]),
                [m, n] => Some([m, n, n]),
                [m, n, k, ..] => Some([m, n, k]),
                [] => None,
            })
            .collect()
    }
    /// The requested shapes as [rows, cols] (a single number means a square), or `default`.
    pub fn shapes_2d(&self, default: [usize; 2]) -> Vec<[usize; 2]> {
        if self.shapes.is_empty() {
            return vec![default];
        }
        self.shapes
            .iter()
            .map(|s| {
                if s.len() >= 2 {
                    [s[0], s[1]]
                } else {
                    [s[0], s[0]]
                }
            })
            .collect()
    }
}

/// Machine ceilings measured at the start of a bench run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Ceilings {
    /// Device-to-device copy, bytes read + written per second / 1e9.
    pub gpu_copy_gbps: Option<f64>,
    /// Vendor GEMM rate per dtype at 4096³ (GFLOP/s), e.g. ("bf16", 7.7e5).
    pub gpu_gemm_gflops: Vec<(String, f64)>,
    /// The CPU peer library's multi-threaded GEMM rate (GFLOP/s).
    pub cpu_peer_gflops: Option<f64>,
    /// Nominal single-core f32 peak: GHz × SIMD lanes × 2 (FMA) × 2 (FMA units).
    pub cpu_core_peak_gflops: Option<f64>,
    /// One core's measured clock, GHz.
    pub cpu_ghz: Option<f64>,
    /// The widest f32 SIMD the CPU runs (`avx512f`, `avx2+fma`, ...).
    pub cpu_isa: String,
    /// Threads of the CPU variants' pool.
    pub cpu_threads: usize,
}

impl Ceilings {
    /// The vendor GEMM rate measured for `dtype` (`f32`, `tf32`, `bf16`, `f16`), GFLOP/s.
    pub fn gpu_gemm(&self, dtype: &str) -> Option<f64> {
        self.gpu_gemm_gflops
            .iter()
            .find(|(d, _)| d == dtype)
            .map(|(_, v)| *v)
    }
}

/// A kernel module and the functions in it, for the build check (`ferrite kernels`).
#[derive(Clone)]
pub struct KernelSpec {
    /// The source and its `-D` specialisation.
    pub program: Program,
    /// The `extern "C"` entry points the PTX must contain.
    pub functions: Vec<String>,
    /// The oldest architecture the module is built for.
    pub min_arch: Arch,
}

/// An op family as the harness sees it.
pub trait OpFamily: Sync {
    /// The family's name on the command line (`matmul`, `attention`, ...).
    fn name(&self) -> &'static str;
    /// The ladder: every variant with what it supports and what it changes.
    fn variants(&self) -> Vec<VariantInfo>;
    /// Runs the checks in `cfg`, appending one record per (variant, device, dtype, shape).
    fn check(&self, cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()>;
    /// Runs the benchmarks in `cfg`; `progress` is called with a short label before each case.
    fn bench(
        &self,
        cfg: &BenchConfig,
        ceilings: &Ceilings,
        progress: &mut dyn FnMut(&str),
        out: &mut Vec<BenchRecord>,
    ) -> Result<()>;
    /// Every kernel module the family compiles, with each specialisation it uses.
    fn kernels(&self) -> Vec<KernelSpec>;
    /// Runs besides the variants that `check` and `bench` do under their own names (so
    /// `--variant` can select them): vendor peers, and rows such as matmul's `default` (the op
    /// with no variant named).
    fn peers(&self) -> Vec<&'static str> {
        Vec::new()
    }
    /// How a call with no variant named picks one, in words (`ferrite info` prints it); None:
    /// the generic rule, the highest-ranked variant that takes the request.
    fn default_rule(&self) -> Option<&'static str> {
        None
    }
    /// Whether `bench` reads the command line's `--size` / `--m --n --k` (families with fixed,
    /// multi-dimensional shapes do not: the CLI refuses those flags for them).
    fn bench_takes_size(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Representative scope keeps a family's headline (its first default) and the first default
    /// dtype; dtypes asked for win over the scope.
    #[test]
    fn representative_scope_keeps_the_headline() {
        let full = BenchConfig::default();
        let rep = BenchConfig {
            representative: true,
            ..Default::default()
        };
        let cases = [[8, 8], [16, 16]];
        assert_eq!(full.scope(&cases), &cases[..]);
        assert_eq!(rep.scope(&cases), &cases[..1]);
        assert!(rep.scope::<u8>(&[]).is_empty());
        let all = [DType::BF16, DType::F32];
        assert_eq!(full.dtypes_in_scope(&all), all.to_vec());
        assert_eq!(rep.dtypes_in_scope(&all), vec![DType::BF16]);
        let asked = BenchConfig {
            dtypes: vec![DType::F32],
            ..rep
        };
        assert_eq!(asked.dtypes_in_scope(&all), vec![DType::F32]);
    }
}
