//! Named variants of an op: what each supports, so the public function can pick the best one that
//! fits a request and a caller (or the CLI) can pick one by name.

use super::device::{Arch, Device};
use super::dtype::DType;
use super::error::{Error, Result};

/// Which kind of device a variant runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Host code (Rust, SIMD, rayon).
    Cpu,
    /// A CUDA kernel (or a vendor library call).
    Cuda,
}

impl Backend {
    /// The backend that runs ops on `device`.
    pub fn of(device: Device) -> Backend {
        match device {
            Device::Cpu => Backend::Cpu,
            Device::Cuda(_) => Backend::Cuda,
        }
    }
}

/// One rung of an op's ladder.
#[derive(Clone, Debug, serde::Serialize)]
pub struct VariantInfo {
    /// The name callers pick it by (`MatmulOptions::variant`, `--variant`); unique per backend.
    pub name: &'static str,
    /// Where it runs.
    pub backend: Backend,
    /// Input dtypes it accepts.
    pub dtypes: &'static [DType],
    /// Oldest GPU architecture it runs on (GPU variants).
    #[serde(skip)]
    pub min_arch: Option<Arch>,
    /// Shape or layout constraints, in words ("any shape").
    pub constraints: &'static str,
    /// What this step changes and why it is faster.
    pub summary: &'static str,
    /// Rank when picking by default: the highest applicable wins.
    pub rank: u32,
}

impl VariantInfo {
    /// Why this variant cannot run `dtype` on a device of `backend`/`arch`, or None if it can.
    pub fn unsupported_reason(
        &self,
        backend: Backend,
        dtype: DType,
        arch: Option<Arch>,
    ) -> Option<String> {
        if self.backend != backend {
            return Some(format!("runs on {:?}, not {:?}", self.backend, backend).to_lowercase());
        }
        if !self.dtypes.contains(&dtype) {
            let names: Vec<&str> = self.dtypes.iter().map(|d| d.name()).collect();
            return Some(format!(
                "supports dtypes [{}], not {dtype}",
                names.join(", ")
            ));
        }
        if let (Some(min), Some(a)) = (self.min_arch, arch) {
            if a < min {
                return Some(format!(
                    "needs {} or newer, device is {}",
                    min.target(),
                    a.target()
                ));
            }
        }
        None
    }
}

/// Picks `requested` (checked) or the best-ranked applicable variant. `extra` lets the op add
/// shape constraints: it
/// returns Some(reason) when a variant cannot take this request.
pub fn select<'a>(
    op: &str,
    variants: &'a [VariantInfo],
    requested: Option<&str>,
    backend: Backend,
    dtype: DType,
    arch: Option<Arch>,
    extra: impl Fn(&VariantInfo) -> Option<String>,
) -> Result<&'a VariantInfo> {
    let why = |v: &VariantInfo| {
        v.unsupported_reason(backend, dtype, arch)
            .or_else(|| extra(v))
    };
    if let Some(name) = requested {
        // The same name may exist on several backends (`naive` on CPU and CUDA): prefer the one
        // for this device.
        let v = variants
            .iter()
            .find(|v| v.name == name && v.backend == backend)
            .or_else(|| variants.iter().find(|v| v.name == name))
            .ok_or_else(|| Error::NoVariant {
                op: op.into(),
                msg: format!(
                    "no variant named `{name}`; variants: {}",
                    variants
                        .iter()
                        .map(|v| v.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
        if let Some(r) = why(v) {
            return Err(Error::NoVariant {
                op: op.into(),
                msg: format!("variant `{name}` cannot run this request: it {r}"),
            });
        }
        return Ok(v);
    }
    variants
        .iter()
        .filter(|v| why(v).is_none())
        .max_by_key(|v| v.rank)
        .ok_or_else(|| {
            let reasons: Vec<String> = variants
                .iter()
                .filter(|v| v.backend == backend)
                .filter_map(|v| why(v).map(|r| format!("`{}` {r}", v.name)))
                .collect();
            Error::NoVariant {
                op: op.into(),
                msg: format!(
                    "no {} variant can run {dtype} here: {}",
                    format!("{backend:?}").to_lowercase(),
                    if reasons.is_empty() {
                        "none exist".to_string()
                    } else {
                        reasons.join("; ")
                    }
                ),
            }
        })
}
