//! Where a tensor lives, and which GPU architecture kernels are built for.

use super::error::{Error, Result};
use std::fmt;

/// Where a tensor's memory lives and where an op on it runs: ops run on their inputs' device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory; the CPU variants of each op.
    Cpu,
    /// The CUDA GPU of this ordinal (as the driver numbers them, `CUDA_VISIBLE_DEVICES` applied).
    Cuda(usize),
}

impl Device {
    /// Whether this is a GPU.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Reads `cpu`, `cuda` / `gpu` (GPU 0) or `cuda:N`, as the CLI's `--device` takes them.
    pub fn parse(s: &str) -> Result<Device> {
        let s = s.trim().to_ascii_lowercase();
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        if s == "cuda" || s == "gpu" {
            return Ok(Device::Cuda(0));
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            if let Ok(i) = n.parse() {
                return Ok(Device::Cuda(i));
            }
        }
        Err(Error::bad_arg(
            "Device::parse",
            "device",
            "cpu, cuda or cuda:N",
            s,
        ))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A GPU architecture ferrite compiles for. Hopper gets the `a` target (wgmma, setmaxnreg).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    /// Compute capability, major part (8 = Ampere/Ada, 9 = Hopper).
    pub major: i32,
    /// Compute capability, minor part.
    pub minor: i32,
}

impl Arch {
    /// Ampere (A100): the oldest architecture ferrite builds for.
    pub const SM80: Arch = Arch { major: 8, minor: 0 };
    /// Ampere consumer and workstation parts (RTX 30xx, A10, A40).
    pub const SM86: Arch = Arch { major: 8, minor: 6 };
    /// Ada (L4, L40, RTX 40xx).
    pub const SM89: Arch = Arch { major: 8, minor: 9 };
    /// Hopper (H100, H200): built as `sm_90a` for wgmma, TMA multicast and setmaxnreg.
    pub const SM90: Arch = Arch { major: 9, minor: 0 };

    /// The compute capability as one number: 80, 86, 89, 90, ...
    pub fn sm(self) -> u32 {
        (self.major * 10 + self.minor) as u32
    }

    /// The NVRTC target for a device of this compute capability, or an error for devices older
    /// than Ampere. Newer devices than Hopper get their own `sm_XY` (PTX JIT by the driver).
    pub fn from_compute_capability(name: &str, major: i32, minor: i32) -> Result<Arch> {
        if major < 8 {
            return Err(Error::UnsupportedArch {
                name: name.into(),
                major,
                minor,
            });
        }
        Ok(Arch { major, minor })
    }

    /// The `--gpu-architecture` string NVRTC gets.
    pub fn target(self) -> &'static str {
        match (self.major, self.minor) {
            (8, 0) => "sm_80",
            (8, 6) => "sm_86",
            (8, 7) => "sm_87",
            (8, 9) => "sm_89",
            (9, 0) => "sm_90a",
            (10, 0) => "sm_100a",
            (12, 0) => "sm_120a",
            // Unknown newer parts: the closest common target; the driver JITs the PTX forward.
            (m, _) if m >= 9 => "sm_90",
            _ => "sm_80",
        }
    }

    /// Whether `target()` names this very chip (so code assembled for it runs here as is).
    pub fn target_is_native(self) -> bool {
        self.target()
            .starts_with(&format!("sm_{}{}", self.major, self.minor))
    }

    /// Reads an NVRTC target as `--arch` takes it (`sm_80`, `sm_90a`, `90`); older than sm_80 is
    /// an error.
    pub fn parse_target(s: &str) -> Result<Arch> {
        let t = s.trim().trim_start_matches("sm_").trim_end_matches('a');
        let v: i32 = t
            .parse()
            .map_err(|_| Error::bad_arg("arch", "target", "sm_80, sm_86, sm_89 or sm_90a", s))?;
        Arch::from_compute_capability(s, v / 10, v % 10)
    }

    /// Hopper-only instructions (wgmma, TMA tensor maps with multicast, setmaxnreg).
    pub fn is_hopper(self) -> bool {
        self.major == 9
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.target())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_targets() {
        assert_eq!(
            Arch::from_compute_capability("H100", 9, 0)
                .unwrap()
                .target(),
            "sm_90a"
        );
        assert_eq!(
            Arch::from_compute_capability("A100", 8, 0)
                .unwrap()
                .target(),
            "sm_80"
        );
        assert_eq!(
            Arch::from_compute_capability("L4", 8, 9).unwrap().target(),
            "sm_89"
        );
        let e = Arch::from_compute_capability("V100", 7, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sm_70") && e.contains("V100") && e.contains("sm_80"),
            "{e}"
        );
        assert_eq!(Arch::parse_target("sm_90a").unwrap(), Arch::SM90);
        // Code assembled for target() runs as is only where target() is the chip itself.
        for (maj, min, native) in [
            (8, 0, true),
            (8, 6, true),
            (9, 0, true),
            (10, 0, true),
            (11, 0, false),
            (13, 0, false),
        ] {
            let a = Arch::from_compute_capability("x", maj, min).unwrap();
            assert_eq!(a.target_is_native(), native, "{maj}.{min} → {}", a.target());
        }
        assert!(Arch::parse_target("sm_75").is_err());
        assert!(Arch::parse_target("banana").is_err());
    }

    #[test]
    fn device_parse() {
        assert_eq!(Device::parse("cuda:1").unwrap(), Device::Cuda(1));
        assert_eq!(Device::parse("CPU").unwrap(), Device::Cpu);
        assert!(Device::parse("tpu").is_err());
    }
}
