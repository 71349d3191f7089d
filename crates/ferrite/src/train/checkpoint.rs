//! Checkpoints in safetensors: a folder with
//!
//! - `model.safetensors` + `config.json`: the weights under Hugging Face's GPT-2 names and layout
//!   (`h.0.attn.c_attn.weight` as `[in, out]`, the vocabulary unpadded), f32 — a folder
//!   `transformers.GPT2LMHeadModel.from_pretrained` loads, and that `import_hf` reads back (GPT-2
//!   models; a Llama checkpoint holds the training state only);
//! - `state.safetensors`: the flat buffers as the trainer holds them (parameters in the model's
//!   dtype, f32 master weights, AdamW moments) and, in its metadata, the configuration, the step
//!   and the loader's position: what an exact resume needs.
//!
//! A save writes a temporary folder beside the target and renames it into place, so a crash never
//! leaves a partial checkpoint under the target's name.

use super::config::{ModelConfig, TrainConfig};
use super::model::Model;
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
    pub model: ModelConfig,
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

/// Hugging Face's name and layout for one of the model's slots: (name, transpose [out, in] → [in, out]).
fn hf_name(slot: &str) -> Option<(String, bool)> {
    let fixed = match slot {
        "wte" => Some("wte.weight"),
        "wpe" => Some("wpe.weight"),
        "lnf_w" => Some("ln_f.weight"),
        "lnf_b" => Some("ln_f.bias"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some((f.to_string(), false));
    }
    let (layer, part) = slot.strip_prefix('h')?.split_once('.')?;
    let (name, t) = match part {
        "ln1_w" => ("ln_1.weight", false),
        "ln1_b" => ("ln_1.bias", false),
        "qkv_w" => ("attn.c_attn.weight", true),
        "qkv_b" => ("attn.c_attn.bias", false),
        "proj_w" => ("attn.c_proj.weight", true),
        "proj_b" => ("attn.c_proj.bias", false),
        "ln2_w" => ("ln_2.weight", false),
        "ln2_b" => ("ln_2.bias", false),
        "fc_w" => ("mlp.c_fc.weight", true),
        "fc_b" => ("mlp.c_fc.bias", false),
        "fcproj_w" => ("mlp.c_proj.weight", true),
        "fcproj_b" => ("mlp.c_proj.bias", false),
        _ => return None,
    };
    Some((format!("h.{layer}.{name}"), t))
}

fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut o = vec![0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            o[c * rows + r] = v[r * cols + c];
        }
    }
    o
}

/// The model's weights as f32 (the master copy for bf16 models), flat in its layout.
fn weights_f32(m: &Model) -> Result<Vec<f32>> {
    match m.state_buffers().0 {
        Some(master) => master.to_f32_vec(),
        None => m.param_buffer().to_f32_vec(),
    }
}

/// GPT2Config as transformers writes it (the fields GPT2LMHeadModel reads).
fn hf_config(cfg: &ModelConfig) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab,
        "n_positions": cfg.max_seq,
        "n_ctx": cfg.max_seq,
        "n_embd": cfg.dim,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": "float32"
    })
}

fn write_hf(m: &Model, dir: &Path) -> Result<()> {
    let w = weights_f32(m)?;
    let cfg = &m.cfg;
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (slot, off, shape) in &m.layout.layout.slots {
        let (name, t) = hf_name(slot)
            .ok_or_else(|| Error::Other(format!("{OP}: no Hugging Face name for `{slot}`")))?;
        let mut shape = shape.clone();
        if slot == "wte" {
            shape[0] = cfg.vocab; // the padded rows are not part of the model
        }
        let n: usize = shape.iter().product();
        let mut v = w[*off..off + n].to_vec();
        if t {
            v = transpose(&v, shape[0], shape[1]);
            shape.swap(0, 1);
        }
        tensors.push((name, shape, bytemuck::cast_slice(&v).to_vec()));
    }
    let views = tensors
        .iter()
        .map(|(n, s, b)| {
            Ok((
                n.clone(),
                TensorView::new(StDtype::F32, s.clone(), b).map_err(st_err(dir))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, &meta, &path).map_err(st_err(&path))?;
    let cfg_path = dir.join("config.json");
    std::fs::write(
        &cfg_path,
        serde_json::to_string_pretty(&hf_config(cfg)).unwrap(),
    )
    .map_err(io(format!("writing {}", cfg_path.display())))
}

fn write_state(m: &Model, dir: &Path, meta: &Meta) -> Result<()> {
    let (master, mom1, mom2) = m.state_buffers();
    let mut bufs: Vec<(&str, &Tensor)> = vec![
        ("params", m.param_buffer()),
        ("exp_avg", mom1),
        ("exp_avg_sq", mom2),
    ];
    if let Some(ms) = master {
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
    // Hugging Face's layout is written for GPT-2; a Llama checkpoint holds the training state.
    let hf = if m.cfg.family == super::config::Family::Gpt2 {
        write_hf(m, &tmp)
    } else {
        Ok(())
    };
    let written = hf.and_then(|_| write_state(m, &tmp, meta));
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
    let t = st.tensor(name).map_err(st_err(path))?;
    let want = st_dtype(like.dtype())?;
    if t.dtype() != want || t.shape() != [like.numel()] {
        return Err(Error::Other(format!(
            "{OP}: {}: `{name}` is {:?} {:?}, the model needs {:?} [{}] (a checkpoint of another configuration?)",
            path.display(),
            t.dtype(),
            t.shape(),
            want,
            like.numel()
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
    let (master, mom1, mom2) = m.state_buffers();
    let mut pairs: Vec<(&str, &Tensor)> = vec![
        ("params", m.param_buffer()),
        ("exp_avg", mom1),
        ("exp_avg_sq", mom2),
    ];
    if let Some(ms) = master {
        pairs.push(("master", ms));
    }
    for (name, t) in pairs {
        let b = expect_buffer(&st, &path, name, t)?;
        super::glue::upload_bytes(t, &b)?;
    }
    Ok(meta)
}

/// Loads Hugging Face GPT-2 weights (`model.safetensors` of GPT2Model/GPT2LMHeadModel: f32, bf16
/// or f16, with or without the `transformer.` prefix) into `m`'s parameters (and master weights);
/// the optimizer state is left as it is.
pub fn import_hf(m: &Model, dir: &Path) -> Result<()> {
    if m.cfg.family != super::config::Family::Gpt2 {
        return Err(Error::bad_arg(
            OP,
            "init_hf",
            "a GPT-2 model (Hugging Face import is written for GPT-2's layout)",
            format!("{:?}", m.cfg.family),
        ));
    }
    let path = if dir.is_dir() {
        dir.join("model.safetensors")
    } else {
        dir.to_path_buf()
    };
    let bytes = read(&path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(st_err(&path))?;
    let names: HashMap<String, String> = st
        .names()
        .into_iter()
        .map(|n| {
            (
                n.strip_prefix("transformer.").unwrap_or(n).to_string(),
                n.clone(),
            )
        })
        .collect();
    let mut flat = weights_f32(m)?;
    for (slot, off, shape) in &m.layout.layout.slots {
        let (name, t) = hf_name(slot).unwrap();
        let full = names.get(&name).ok_or_else(|| {
            Error::Other(format!(
                "{OP}: {}: no tensor `{name}` (for `{slot}`)",
                path.display()
            ))
        })?;
        let view = st.tensor(full).map_err(st_err(&path))?;
        let mut want = shape.clone();
        if slot == "wte" {
            want[0] = m.cfg.vocab;
        }
        if t {
            want.swap(0, 1);
        }
        if view.shape() != want.as_slice() {
            return Err(Error::Other(format!(
                "{OP}: {}: `{name}` is {:?}, this model needs {want:?}",
                path.display(),
                view.shape()
            )));
        }
        let data = view.data();
        let v: Vec<f32> = match view.dtype() {
            StDtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            StDtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            StDtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(Error::Other(format!(
                    "{OP}: {}: `{name}` has dtype {other:?}",
                    path.display()
                )))
            }
        };
        let v = if t {
            transpose(&v, want[0], want[1])
        } else {
            v
        };
        flat[*off..off + v.len()].copy_from_slice(&v);
    }
    super::glue::upload(m.param_buffer(), &flat)?;
    if let Some(ms) = m.state_buffers().0 {
        super::glue::upload(ms, &flat)?;
    }
    Ok(())
}
