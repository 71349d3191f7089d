//! Checkpoints in safetensors: a folder with
//!
//! - `model.safetensors` + `config.json`: the weights under Hugging Face's names and layout for
//!   the family (see `hf`), f32 — a folder `transformers`' `from_pretrained` loads (GPT2LMHeadModel,
//!   LlamaForCausalLM), and that `import_hf` reads back;
//! - `state.safetensors`: the flat buffers as the trainer holds them (parameters in the model's
//!   dtype, f32 master weights, AdamW moments) and, in its metadata, the configuration, the step
//!   and the loader's position: what an exact resume needs.
//!
//! A save writes a temporary folder beside the target and renames it into place, so a crash never
//! leaves a partial checkpoint under the target's name.

use super::config::{ModelConfig, TrainConfig};
use super::model::{FlatState, Model};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use crate::data::LoaderState;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const OP: &str = "train checkpoint";

/// What `state.safetensors` records besides the buffers.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Meta {
    /// The model's shape.
    pub model: ModelConfig,
    /// The run's settings (a resumed run continues the same schedule).
    pub train: TrainConfig,
    /// Optimizer steps done.
    pub step: usize,
    /// The loader's position after the last batch consumed.
    pub loader: Option<LoaderState>,
    /// The parameters' dtype ("f32" or "bf16").
    pub dtype: String,
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::io(what, e)
}

fn st_err(path: &Path) -> impl Fn(safetensors::SafeTensorError) -> Error + '_ {
    move |e| Error::Other(format!("{OP}: {}: {e}", path.display()))
}

fn st_dtype(d: DType) -> Result<StDtype> {
    Ok(match d {
        DType::F32 => StDtype::F32,
        DType::BF16 => StDtype::BF16,
        DType::F16 => StDtype::F16,
        other => return Err(Error::bad_arg(OP, "dtype", "f32, bf16 or f16", other)),
    })
}

/// The weights as f32 (the master copy for bf16 models), flat in the model's layout.
fn weights_f32(s: &FlatState) -> Result<Vec<f32>> {
    s.master.as_ref().unwrap_or(&s.params).to_f32_vec()
}

fn write_state(s: &FlatState, dir: &Path, meta: &Meta) -> Result<()> {
    let mut bufs: Vec<(&str, &Tensor)> = vec![
        ("params", &s.params),
        ("exp_avg", &s.exp_avg),
        ("exp_avg_sq", &s.exp_avg_sq),
    ];
    if let Some(ms) = &s.master {
        bufs.push(("master", ms));
    }
    let bytes: Vec<(String, DType, usize, Vec<u8>)> = bufs
        .iter()
        .map(|(n, t)| Ok((n.to_string(), t.dtype(), t.numel(), t.to_bytes()?)))
        .collect::<Result<_>>()?;
    let views = bytes
        .iter()
        .map(|(n, d, len, b)| {
            Ok((
                n.clone(),
                TensorView::new(st_dtype(*d)?, vec![*len], b).map_err(st_err(dir))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let info = Some(HashMap::from([(
        "ferrite".to_string(),
        serde_json::to_string(meta).unwrap(),
    )]));
    let path = dir.join("state.safetensors");
    safetensors::serialize_to_file(views, &info, &path).map_err(st_err(&path))
}

/// Saves `m` (and the run's `meta`) to the folder `dir`, replacing it as a whole.
pub fn save(m: &Model, dir: &Path, meta: &Meta) -> Result<()> {
    save_state(m, &m.flat_state(None)?, dir, meta)
}

/// Saves `m` with its training state `state` (from [`Model::flat_state`], gathered over the
/// ranks for a ZeRO-1 model).
pub fn save_state(m: &Model, state: &FlatState, dir: &Path, meta: &Meta) -> Result<()> {
    let name = dir
        .file_name()
        .ok_or_else(|| Error::bad_arg(OP, "dir", "a folder path with a name", dir.display()))?;
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
    let tmp: PathBuf = parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(format!("creating {}", tmp.display())))?;
    let written = weights_f32(state)
        .and_then(|w| super::hf::write(m, &w, &tmp))
        .and_then(|_| write_state(state, &tmp, meta));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // Swap in: the old checkpoint (if any) moves aside first and is removed once the new one is
    // in place, so the name always holds a whole checkpoint (or, between two renames, none).
    let old = parent.join(format!(
        ".{}.old-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let had_old = dir.exists();
    if had_old {
        std::fs::rename(dir, &old).map_err(io(format!("moving {} aside", dir.display())))?;
    }
    std::fs::rename(&tmp, dir).map_err(io(format!(
        "renaming {} to {}",
        tmp.display(),
        dir.display()
    )))?;
    if had_old {
        let _ = std::fs::remove_dir_all(&old);
    }
    Ok(())
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(io(format!("reading checkpoint file {}", path.display())))
}

/// Reads `state.safetensors`' metadata (configuration, step, loader position).
pub fn read_meta(dir: &Path) -> Result<Meta> {
    let path = dir.join("state.safetensors");
    let bytes = read(&path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(st_err(&path))?;
    let (_, md) = SafeTensors::read_metadata(&bytes).map_err(st_err(&path))?;
    drop(st);
    let json = md
        .metadata()
        .as_ref()
        .and_then(|m| m.get("ferrite"))
        .ok_or_else(|| {
            Error::Other(format!(
                "{OP}: {}: no ferrite metadata (not a ferrite training state)",
                path.display()
            ))
        })?;
    serde_json::from_str(json)
        .map_err(|e| Error::Other(format!("{OP}: {}: metadata: {e}", path.display())))
}

fn expect_buffer(st: &SafeTensors, path: &Path, name: &str, like: &Tensor) -> Result<Vec<u8>> {
    expect_buffer_len(st, path, name, like.dtype(), like.numel())
}

fn expect_buffer_len(
    st: &SafeTensors,
    path: &Path,
    name: &str,
    dtype: DType,
    numel: usize,
) -> Result<Vec<u8>> {
    let t = st.tensor(name).map_err(st_err(path))?;
    let want = st_dtype(dtype)?;
    if t.dtype() != want || t.shape() != [numel] {
        return Err(Error::Other(format!(
            "{OP}: {}: `{name}` is {:?} {:?}, the model needs {:?} [{}] (a checkpoint of another configuration?)",
            path.display(),
            t.dtype(),
            t.shape(),
            want,
            numel
        )));
    }
    Ok(t.data().to_vec())
}

/// Restores the exact training state saved by `save` into `m` (same model configuration and
/// dtype) and returns its metadata.
pub fn load_state(m: &Model, dir: &Path) -> Result<Meta> {
    let meta = read_meta(dir)?;
    if meta.model != m.cfg {
        return Err(Error::bad_arg(
            OP,
            "resume",
            format!("a checkpoint of this model ({:?})", m.cfg),
            format!("{} holds {:?}", dir.display(), meta.model),
        ));
    }
    if meta.dtype != m.dtype.name() {
        return Err(Error::bad_arg(
            OP,
            "resume",
            format!("a {} checkpoint", m.dtype),
            &meta.dtype,
        ));
    }
    let path = dir.join("state.safetensors");
    let bytes = read(&path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(st_err(&path))?;
    let n = m.layout.len();
    let params = m.param_buffer().narrow(0, 0, n)?;
    let (master, mom1, mom2) = m.state_buffers();
    let mut pairs: Vec<(&str, &Tensor, bool)> = vec![
        ("params", &params, false),
        ("exp_avg", mom1, true),
        ("exp_avg_sq", mom2, true),
    ];
    if let Some(ms) = master {
        pairs.push(("master", ms, true));
    }
    // A ZeRO-1 model takes its shard of the optimizer state (a checkpoint holds the whole, so it
    // resumes on any number of ranks).
    let (lo, hi) = m.shard().map_or((0, n), |s| s.range());
    let end = hi.min(n);
    for (name, t, sharded) in pairs {
        if sharded && m.shard().is_some() {
            let b = expect_buffer_len(&st, &path, name, t.dtype(), n)?;
            if end > lo {
                let es = t.dtype().size_in_bytes();
                super::glue::upload_bytes(&t.narrow(0, 0, end - lo)?, &b[lo * es..end * es])?;
            }
        } else {
            let b = expect_buffer(&st, &path, name, t)?;
            super::glue::upload_bytes(t, &b)?;
        }
    }
    Ok(meta)
}

/// Loads Hugging Face weights of the model's family (`model.safetensors` of GPT2LMHeadModel or
/// LlamaForCausalLM: f32, bf16 or f16) into `m`'s parameters (and master weights); the optimizer
/// state is left as it is.
pub fn import_hf(m: &Model, dir: &Path) -> Result<()> {
    let path = if dir.is_dir() {
        dir.join("model.safetensors")
    } else {
        dir.to_path_buf()
    };
    let n = m.layout.len();
    // Under ZeRO-1 the master weights are a shard: start from the full (bf16) weights instead;
    // every parameter tensor is overwritten by the import.
    let mut flat = match (m.shard(), m.state_buffers().0) {
        (None, Some(master)) => master.to_f32_vec()?,
        _ => m.param_buffer().narrow(0, 0, n)?.to_f32_vec()?,
    };
    super::hf::import(m, &path, &mut flat)?;
    super::glue::upload(&m.param_buffer().narrow(0, 0, n)?, &flat)?;
    if let Some(ms) = m.state_buffers().0 {
        let (lo, hi) = m.shard().map_or((0, n), |s| s.range());
        let end = hi.min(n);
        if end > lo {
            super::glue::upload(&ms.narrow(0, 0, end - lo)?, &flat[lo..end])?;
        }
    }
    Ok(())
}
