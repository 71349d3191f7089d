//! Kernels compiled at run time. `.cu` sources are embedded in the binary (`include_str!`), NVRTC
//! compiles them for the device's architecture with `-D` specialisations, and the PTX is cached on
//! disk keyed by a hash of (source, arch, options, NVRTC version): a second run compiles nothing.
//!
//! Sources may include the shared device headers of `core/cuda/kernels/` — `ferrite.cuh`
//! (conversions, block reductions, vector types, `red_add2`), `async.cuh` (cp.async), `mma.cuh`
//! (ldmatrix, mma.sync, 16-bit packing, tf32 rounding), `hopper.cuh` (mbarrier, TMA, wgmma, named
//! barriers), `sfu.cuh` (one-instruction 2^x, 1/x, tanh), `act.cuh` (activations and their
//! derivatives), `philox.cuh`, `fp8.cuh`; the includes are expanded here, so NVRTC needs only the
//! CUDA headers (`cuda_fp16.h`, `cuda_bf16.h`), found from the usual places. A PTX-wrapping helper
//! that more than one kernel module needs lives in one of them, written once (the host emulators,
//! `scripts/*-emu`, remove such helpers by name and model them).

use super::{CudaDevice, Kernel};
use crate::core::device::Arch;
use crate::core::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// A `.cu` file of an op family, embedded at build time.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// Module name used in messages and reports, e.g. `matmul/naive`.
    pub name: &'static str,
    /// The source text.
    pub src: &'static str,
}

/// Embeds a `.cu` file that sits next to the Rust file naming it.
#[macro_export]
macro_rules! kernel_source {
    ($name:expr, $file:expr) => {
        $crate::core::cuda::jit::KernelSource {
            name: $name,
            src: include_str!($file),
        }
    };
}

/// Shared device helpers every kernel may include.
const HEADERS: &[(&str, &str)] = &[
    ("ferrite.cuh", include_str!("kernels/ferrite.cuh")),
    ("philox.cuh", include_str!("kernels/philox.cuh")),
    ("hopper.cuh", include_str!("kernels/hopper.cuh")),
    ("async.cuh", include_str!("kernels/async.cuh")),
    ("act.cuh", include_str!("kernels/act.cuh")),
    ("mma.cuh", include_str!("kernels/mma.cuh")),
    ("fp8.cuh", include_str!("kernels/fp8.cuh")),
    ("sfu.cuh", include_str!("kernels/sfu.cuh")),
];

/// A source plus the `-D` definitions that specialise it (tile sizes, dtypes, flags).
#[derive(Clone, Debug)]
pub struct Program {
    /// The `.cu` module.
    pub source: KernelSource,
    /// `-D` definitions, in order: `(name, value)`.
    pub defines: Vec<(String, String)>,
}

impl Program {
    /// `source` with no definitions.
    pub fn new(source: KernelSource) -> Self {
        Program {
            source,
            defines: Vec::new(),
        }
    }
    /// Adds `-Dname=value`.
    pub fn define(mut self, name: &str, value: impl ToString) -> Self {
        self.defines.push((name.to_string(), value.to_string()));
        self
    }
    /// A readable label: `matmul/naive[T=float]`.
    pub fn label(&self) -> String {
        if self.defines.is_empty() {
            return self.source.name.to_string();
        }
        let d: Vec<String> = self
            .defines
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!("{}[{}]", self.source.name, d.join(","))
    }
}

/// Expands `#include "X"` lines naming an embedded header.
fn expand_includes(src: &str) -> String {
    let mut out = String::with_capacity(src.len() + 4096);
    for line in src.lines() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("#include \"") {
            // The name ends at the closing quote (a comment may follow it).
            let name = rest.split('"').next().unwrap_or("");
            if let Some((_, h)) = HEADERS.iter().find(|(n, _)| *n == name) {
                out.push_str(&expand_includes(h));
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Folders holding `cuda_fp16.h`: `FERRITE_CUDA_INCLUDE`, `CUDA_HOME`/`CUDA_PATH`, the toolkit's
/// default place, and the `include` beside any `lib` folder on `LD_LIBRARY_PATH` (pip's wheels).
pub fn cuda_include_dirs() -> Vec<String> {
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Ok(v) = std::env::var("FERRITE_CUDA_INCLUDE") {
        cands.push(v.into());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            cands.push(Path::new(&v).join("include"));
        }
    }
    cands.push("/usr/local/cuda/include".into());
    cands.push("/usr/local/cuda/targets/x86_64-linux/include".into());
    if let Ok(v) = std::env::var("LD_LIBRARY_PATH") {
        for p in v.split(':').filter(|p| !p.is_empty()) {
            if let Some(parent) = Path::new(p).parent() {
                cands.push(parent.join("include"));
            }
        }
    }
    let mut out: Vec<String> = Vec::new();
    for c in cands {
        if c.join("cuda_fp16.h").exists() {
            let s = c.to_string_lossy().into_owned();
            if !out.contains(&s) {
                out.push(s);
            }
        }
    }
    out
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    super::nvrtc_available()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both out-pointers are valid for writes.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::cuda("nvrtcVersion", format!("{e:?}")))?;
    Ok((major, minor))
}

/// Where compiled PTX (and tuning results) are kept: `FERRITE_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/ferrite`, else `~/.cache/ferrite`, else a temp folder.
pub fn cache_dir() -> PathBuf {
    if let Ok(v) = std::env::var("FERRITE_CACHE_DIR") {
        return v.into();
    }
    if let Ok(v) = std::env::var("XDG_CACHE_HOME") {
        return Path::new(&v).join("ferrite");
    }
    if let Ok(v) = std::env::var("HOME") {
        return Path::new(&v).join(".cache").join("ferrite");
    }
    std::env::temp_dir().join("ferrite-cache")
}

/// The PTX of a program for one architecture, and whether it came from the disk cache.
#[derive(Clone, Debug)]
pub struct CompiledPtx {
    /// The program's label ([`Program::label`]).
    pub label: String,
    /// The cache key: SHA-256 (hex) of the expanded source, name, options and NVRTC version.
    pub key: String,
    /// The PTX text.
    pub ptx: String,
    /// The SASS NVRTC assembled for `arch` (real `sm_` targets only). Loading it skips the
    /// driver's PTX JIT, which for the big wgmma modules costs seconds per module in every fresh
    /// process — more than NVRTC's own compile once the disk cache is warm.
    pub cubin: Option<Vec<u8>>,
    /// Read from the disk cache rather than compiled now.
    pub from_cache: bool,
    /// The architecture it was compiled for.
    pub arch: Arch,
}

fn options_for(program: &Program, arch: Arch, includes: &[String]) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={}", arch.target()),
        "-std=c++17".to_string(),
        "-lineinfo".to_string(),
        "-default-device".to_string(),
    ];
    for (k, v) in &program.defines {
        opts.push(format!("-D{k}={v}"));
    }
    for i in includes {
        opts.push(format!("-I{i}"));
    }
    opts
}

/// The environment variable naming a folder of replacement kernel sources (a developer's knob):
/// `$FERRITE_KERNEL_DIR/matmul/warptile.cu` replaces the embedded `matmul/warptile` module. It
/// lets one GPU run compare edited kernels with the built ones without rebuilding the binary;
/// the cache key hashes the text, so an edit never reuses stale PTX.
pub const KERNEL_DIR_VAR: &str = "FERRITE_KERNEL_DIR";

/// The module's text: the replacement under `FERRITE_KERNEL_DIR` when one exists there, else the
/// embedded source.
fn source_text(source: &KernelSource) -> Result<std::borrow::Cow<'static, str>> {
    source_text_in(source, std::env::var_os(KERNEL_DIR_VAR).as_deref())
}

fn source_text_in(
    source: &KernelSource,
    dir: Option<&std::ffi::OsStr>,
) -> Result<std::borrow::Cow<'static, str>> {
    let Some(dir) = dir.filter(|d| !d.is_empty()) else {
        return Ok(source.src.into());
    };
    let path = Path::new(dir).join(format!("{}.cu", source.name));
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(text.into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(source.src.into()),
        Err(e) => Err(Error::io(
            format!(
                "{KERNEL_DIR_VAR}: reading the replacement source {}",
                path.display()
            ),
            e,
        )),
    }
}

/// Compiles `program` for `arch`, or reads it from the disk cache.
pub fn compile(program: &Program, arch: Arch) -> Result<CompiledPtx> {
    let (vmaj, vmin) = nvrtc_version()?;
    let src = expand_includes(&source_text(&program.source)?);
    let includes = cuda_include_dirs();
    let opts = options_for(program, arch, &includes);
    // The include paths are machine-specific and do not change the PTX: leave them out of the key.
    let key_opts: Vec<&String> = opts.iter().filter(|o| !o.starts_with("-I")).collect();
    let mut h = Sha256::new();
    h.update(src.as_bytes());
    h.update(program.source.name.as_bytes());
    for o in &key_opts {
        h.update(b"\0");
        h.update(o.as_bytes());
    }
    h.update(format!("\0nvrtc {vmaj}.{vmin}").as_bytes());
    let digest = h.finalize();
    let key: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    let label = program.label();
    let path = cache_dir().join("ptx").join(format!("{key}.ptx"));
    let cubin_path = path.with_extension("cubin");
    let wants_cubin = arch.target().starts_with("sm_");
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        let cubin = std::fs::read(&cubin_path).ok().filter(|c| !c.is_empty());
        // An entry written before cubins were kept is recompiled once to gain its cubin.
        if ptx.contains(".target") && (cubin.is_some() || !wants_cubin) {
            return Ok(CompiledPtx {
                label,
                key,
                ptx,
                cubin,
                from_cache: true,
                arch,
            });
        }
    }
    let (ptx, cubin) = nvrtc_compile(&src, &label, &opts, arch)?;
    // A cache write failure only costs a recompile next time; say nothing and go on. The cubin
    // is written first, so a reader that finds the PTX finds its cubin too.
    if std::fs::create_dir_all(path.parent().unwrap()).is_ok() {
        if let Some(c) = &cubin {
            write_atomically(&cubin_path, c);
        }
        write_atomically(&path, ptx.as_bytes());
    }
    Ok(CompiledPtx {
        label,
        key,
        ptx,
        cubin,
        from_cache: false,
        arch,
    })
}

/// Writes through a temporary name and a rename, so concurrent readers see a whole file or none.
fn write_atomically(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

/// PTX, and for a real `sm_` target the cubin NVRTC assembled along with it.
fn nvrtc_compile(
    src: &str,
    label: &str,
    opts: &[String],
    arch: Arch,
) -> Result<(String, Option<Vec<u8>>)> {
    use cudarc::nvrtc::result as nv;
    let csrc = std::ffi::CString::new(src)
        .map_err(|_| Error::Other(format!("kernel source {label} contains a NUL byte")))?;
    let cname = std::ffi::CString::new(label.replace('/', "_") + ".cu").unwrap();
    let fail = |log: String| Error::Compile {
        module: label.to_string(),
        arch: arch.target().to_string(),
        options: opts
            .iter()
            .filter(|o| !o.starts_with("-I"))
            .cloned()
            .collect::<Vec<_>>()
            .join(" "),
        log,
    };
    let prog = nv::create_program(&csrc, Some(&cname)).map_err(|e| fail(format!("{e:?}")))?;
    // SAFETY: prog is a live program; options are valid C strings; destroyed below on all paths.
    let compiled = unsafe { nv::compile_program(prog, opts) };
    // SAFETY: prog is live.
    let log = unsafe { nv::get_program_log(prog) }
        .map(|raw| {
            // SAFETY: NVRTC returns a NUL-terminated log.
            unsafe { std::ffi::CStr::from_ptr(raw.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    let result = match compiled {
        Err(e) => Err(fail(if log.trim().is_empty() {
            format!("{e:?}")
        } else {
            first_lines(&log, 60)
        })),
        // SAFETY: prog compiled successfully.
        Ok(()) => unsafe { nv::get_ptx(prog) }
            .map(|raw| {
                // SAFETY: NVRTC returns NUL-terminated PTX text.
                unsafe { std::ffi::CStr::from_ptr(raw.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .map_err(|e| fail(format!("nvrtcGetPTX: {e:?}")))
            .map(|ptx| {
                // SAFETY: prog compiled successfully (a compute_ target simply has no cubin).
                let cubin = arch
                    .target()
                    .starts_with("sm_")
                    .then(|| unsafe { get_cubin(prog) })
                    .flatten();
                (ptx, cubin)
            }),
    };
    // SAFETY: prog is live and destroyed once.
    let _ = unsafe { nv::destroy_program(prog) };
    result
}

/// The cubin of a compiled program, or None when NVRTC made none.
///
/// # Safety
/// `prog` must be a live program that compiled successfully.
unsafe fn get_cubin(prog: cudarc::nvrtc::sys::nvrtcProgram) -> Option<Vec<u8>> {
    use cudarc::nvrtc::sys;
    let mut size = 0usize;
    // SAFETY: prog is live (caller); size is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .ok()?;
    if size == 0 {
        return None;
    }
    let mut buf = vec![0u8; size];
    // SAFETY: buf holds exactly the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) }
        .result()
        .ok()?;
    Some(buf)
}

/// The first `n` lines of a long compiler log (the first errors are the ones that matter).
fn first_lines(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    if lines.len() <= n {
        return log.to_string();
    }
    format!(
        "{}\n... ({} more lines)",
        lines[..n].join("\n"),
        lines.len() - n
    )
}

type KernelKey = (usize, String, String);

impl CudaDevice {
    /// The kernel `func` of `program`, compiled for this device (disk- and memory-cached).
    pub fn kernel(self: &Arc<Self>, program: &Program, func: &str) -> Result<Kernel> {
        static KERNELS: OnceLock<Mutex<HashMap<KernelKey, Kernel>>> = OnceLock::new();
        let label = program.label();
        let k = (self.ordinal(), label.clone(), func.to_string());
        if let Some(kern) = KERNELS
            .get_or_init(Default::default)
            .lock()
            .unwrap()
            .get(&k)
        {
            return Ok(kern.clone());
        }
        let compiled = compile(program, self.arch())?;
        // The cubin only where it was assembled for exactly this chip (an unknown newer part gets
        // an older target's PTX, which the driver JITs forward).
        let cubin = compiled
            .cubin
            .as_deref()
            .filter(|_| self.arch().target_is_native());
        let module = self.module(&compiled.key, &compiled.ptx, cubin)?;
        let f = module
            .load_function(func)
            .map_err(|e| Error::cuda(format!("cuModuleGetFunction({func} in {label})"), e))?;
        let static_smem = f
            .shared_size_bytes()
            .map_err(|e| Error::cuda(format!("cuFuncGetAttribute({func} in {label})"), e))?
            as u32;
        let kern = Kernel {
            name: format!("{func} ({label})"),
            func: f,
            dev: self.clone(),
            static_smem,
            facts: Default::default(),
        };
        KERNELS
            .get_or_init(Default::default)
            .lock()
            .unwrap()
            .insert(k, kern.clone());
        Ok(kern)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn includes_are_expanded() {
        let s = expand_includes("#include \"ferrite.cuh\"\nint x;\n#include <cuda_fp16.h>\n");
        assert!(s.contains("FERRITE_CUH"));
        assert!(s.contains("#include <cuda_fp16.h>"));
        assert!(!s.contains("#include \"ferrite.cuh\""));
        // Nested shared headers, and a comment after the name.
        let h = expand_includes("#include \"hopper.cuh\"  // mbarriers\n");
        assert!(h.contains("FERRITE_HOPPER_CUH") && h.contains("FERRITE_CUH"));
        assert!(!h.contains("#include \"hopper.cuh\"") && !h.contains("#include \"ferrite.cuh\""));
    }

    /// A file under the replacement folder wins over the embedded text; a module with no file
    /// there keeps its own; a path that exists but cannot be read is an error naming it.
    #[test]
    fn replacement_sources_override_the_embedded_ones() {
        const SRC: KernelSource = KernelSource {
            name: "fam/probe",
            src: "embedded",
        };
        const OTHER: KernelSource = KernelSource {
            name: "fam/other",
            src: "other embedded",
        };
        let dir = std::env::temp_dir().join(format!("ferrite-kdir-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("fam/other.cu")).unwrap(); // a folder: unreadable
        std::fs::write(dir.join("fam/probe.cu"), "replaced").unwrap();
        let d = Some(dir.as_os_str());
        assert_eq!(source_text_in(&SRC, d).unwrap(), "replaced");
        assert_eq!(source_text_in(&SRC, None).unwrap(), "embedded");
        assert_eq!(source_text_in(&SRC, Some("".as_ref())).unwrap(), "embedded");
        let missing = dir.join("nowhere");
        assert_eq!(
            source_text_in(&SRC, Some(missing.as_os_str())).unwrap(),
            "embedded"
        );
        let err = source_text_in(&OTHER, d).unwrap_err().to_string();
        assert!(
            err.contains("FERRITE_KERNEL_DIR") && err.contains("other.cu"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A real `sm_` target yields a cubin (an ELF image) beside the PTX, and the disk cache gives
    /// both back; a `compute_`-only use is not asked for here (every target() is an `sm_`).
    #[test]
    fn sm_targets_keep_their_cubin() {
        if crate::core::cuda::nvrtc_available().is_err() {
            eprintln!("NVRTC not available: skipped");
            return;
        }
        const SRC: KernelSource = KernelSource {
            name: "cubin_probe",
            src: "extern \"C\" __global__ void probe(float* x) { x[threadIdx.x] *= FE_SCALE; }\n",
        };
        let prog =
            Program::new(SRC).define("FE_SCALE", format!("{}.5f", std::process::id() % 1000));
        let first = compile(&prog, Arch::SM80).unwrap();
        let cubin = first.cubin.as_ref().expect("sm_80 compile has a cubin");
        assert_eq!(&cubin[..4], b"\x7fELF", "cubin is an ELF image");
        assert!(first.ptx.contains(".entry probe("));
        let again = compile(&prog, Arch::SM80).unwrap();
        assert!(again.from_cache, "second compile reads the disk cache");
        assert_eq!(again.cubin.as_ref(), Some(cubin));
    }
}
