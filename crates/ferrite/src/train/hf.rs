//! Hugging Face's names and layouts for the trainer's parameters: GPT-2 (`GPT2LMHeadModel`:
//! Conv1D weights stored `[in, out]`, the classifier tied) and Llama (`LlamaForCausalLM`: q, k, v
//! and gate, up as separate `[out, in]` projections, an untied `lm_head`). The vocabulary is
//! written unpadded. `write` makes a folder `from_pretrained` loads; `import` reads one back.

use super::config::{Family, ModelConfig};
use super::model::Model;
use crate::core::error::{Error, Result};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

const OP: &str = "train checkpoint (Hugging Face)";

/// One Hugging Face tensor: rows `rows` of the trainer's slot `slot` (a `[rows, cols]` matrix or
/// a vector), transposed for GPT-2's Conv1D.
struct Piece {
    name: String,
    slot: String,
    rows: Range<usize>,
    transpose: bool,
}

fn pieces(cfg: &ModelConfig) -> Vec<Piece> {
    let p = |name: String, slot: String, rows: Range<usize>, transpose: bool| Piece {
        name,
        slot,
        rows,
        transpose,
    };
    let (c, d, f) = (cfg.dim, cfg.head_dim(), cfg.ffn);
    let mut v = Vec::new();
    match cfg.family {
        Family::Gpt2 => {
            v.push(p("wte.weight".into(), "wte".into(), 0..cfg.vocab, false));
            v.push(p("wpe.weight".into(), "wpe".into(), 0..cfg.max_seq, false));
            for i in 0..cfg.layers {
                let h = |n: &str| format!("h.{i}.{n}");
                let s = |n: &str| format!("h{i}.{n}");
                v.push(p(h("ln_1.weight"), s("ln1_w"), 0..c, false));
                v.push(p(h("ln_1.bias"), s("ln1_b"), 0..c, false));
                v.push(p(h("attn.c_attn.weight"), s("qkv_w"), 0..3 * c, true));
                v.push(p(h("attn.c_attn.bias"), s("qkv_b"), 0..3 * c, false));
                v.push(p(h("attn.c_proj.weight"), s("proj_w"), 0..c, true));
                v.push(p(h("attn.c_proj.bias"), s("proj_b"), 0..c, false));
                v.push(p(h("ln_2.weight"), s("ln2_w"), 0..c, false));
                v.push(p(h("ln_2.bias"), s("ln2_b"), 0..c, false));
                v.push(p(h("mlp.c_fc.weight"), s("fc_w"), 0..f, true));
                v.push(p(h("mlp.c_fc.bias"), s("fc_b"), 0..f, false));
                v.push(p(h("mlp.c_proj.weight"), s("fcproj_w"), 0..c, true));
                v.push(p(h("mlp.c_proj.bias"), s("fcproj_b"), 0..c, false));
            }
            v.push(p("ln_f.weight".into(), "lnf_w".into(), 0..c, false));
            v.push(p("ln_f.bias".into(), "lnf_b".into(), 0..c, false));
        }
        Family::Llama => {
            let (q, kv) = (cfg.heads * d, cfg.kv_heads * d);
            v.push(p(
                "model.embed_tokens.weight".into(),
                "wte".into(),
                0..cfg.vocab,
                false,
            ));
            for i in 0..cfg.layers {
                let h = |n: &str| format!("model.layers.{i}.{n}");
                let s = |n: &str| format!("h{i}.{n}");
                v.push(p(h("input_layernorm.weight"), s("ln1_w"), 0..c, false));
                v.push(p(h("self_attn.q_proj.weight"), s("qkv_w"), 0..q, false));
                v.push(p(
                    h("self_attn.k_proj.weight"),
                    s("qkv_w"),
                    q..q + kv,
                    false,
                ));
                v.push(p(
                    h("self_attn.v_proj.weight"),
                    s("qkv_w"),
                    q + kv..q + 2 * kv,
                    false,
                ));
                v.push(p(h("self_attn.o_proj.weight"), s("proj_w"), 0..c, false));
                v.push(p(
                    h("post_attention_layernorm.weight"),
                    s("ln2_w"),
                    0..c,
                    false,
                ));
                v.push(p(h("mlp.gate_proj.weight"), s("fc_w"), 0..f, false));
                v.push(p(h("mlp.up_proj.weight"), s("fc_w"), f..2 * f, false));
                v.push(p(h("mlp.down_proj.weight"), s("fcproj_w"), 0..c, false));
            }
            v.push(p("model.norm.weight".into(), "lnf_w".into(), 0..c, false));
            v.push(p(
                "lm_head.weight".into(),
                "head".into(),
                0..cfg.vocab,
                false,
            ));
        }
    }
    v
}

/// The config.json `transformers` reads for the family.
fn config(cfg: &ModelConfig) -> serde_json::Value {
    match cfg.family {
        Family::Gpt2 => serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab,
            "n_positions": cfg.max_seq,
            "n_ctx": cfg.max_seq,
            "n_embd": cfg.dim,
            "n_layer": cfg.layers,
            "n_head": cfg.heads,
            "n_inner": cfg.ffn,
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
        }),
        Family::Llama => serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": cfg.vocab,
            "hidden_size": cfg.dim,
            "intermediate_size": cfg.ffn,
            "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim(),
            "max_position_embeddings": cfg.max_seq,
            "rms_norm_eps": 1e-5,
            "rope_theta": cfg.rope_theta as f64,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "tie_word_embeddings": false,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "torch_dtype": "float32"
        }),
    }
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

/// (offset, cols) of every slot.
fn slots(m: &Model) -> HashMap<&str, (usize, usize)> {
    m.layout
        .layout
        .slots
        .iter()
        .map(|(n, off, shape)| {
            (
                n.as_str(),
                (*off, if shape.len() == 2 { shape[1] } else { 1 }),
            )
        })
        .collect()
}

/// Writes `model.safetensors` (f32) and `config.json` of `weights` (flat, in `m`'s layout).
pub fn write(m: &Model, weights: &[f32], dir: &Path) -> Result<()> {
    let map = slots(m);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for pc in pieces(&m.cfg) {
        let (off, cols) = map[pc.slot.as_str()];
        let rows = pc.rows.len();
        let mut v = weights[off + pc.rows.start * cols..off + pc.rows.end * cols].to_vec();
        let shape = if cols == 1 {
            vec![rows]
        } else if pc.transpose {
            v = transpose(&v, rows, cols);
            vec![cols, rows]
        } else {
            vec![rows, cols]
        };
        tensors.push((pc.name, shape, bytemuck::cast_slice(&v).to_vec()));
    }
    let err =
        |e: safetensors::SafeTensorError| Error::Other(format!("{OP}: {}: {e}", dir.display()));
    let views = tensors
        .iter()
        .map(|(n, s, b)| {
            Ok((
                n.clone(),
                TensorView::new(StDtype::F32, s.clone(), b).map_err(err)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::serialize_to_file(views, &meta, &dir.join("model.safetensors")).map_err(err)?;
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&config(&m.cfg)).unwrap(),
    )
    .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Reads Hugging Face weights (f32, bf16 or f16; GPT-2 with or without the `transformer.`
/// prefix) into `weights` (flat, in `m`'s layout); every tensor the family needs must be there
/// with its shape.
pub fn import(m: &Model, path: &Path, weights: &mut [f32]) -> Result<()> {
    let bytes =
        std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let err =
        |e: safetensors::SafeTensorError| Error::Other(format!("{OP}: {}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).map_err(err)?;
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
    let map = slots(m);
    for pc in pieces(&m.cfg) {
        let (off, cols) = map[pc.slot.as_str()];
        let rows = pc.rows.len();
        let full = names.get(&pc.name).ok_or_else(|| {
            Error::Other(format!(
                "{OP}: {}: no tensor `{}` (for `{}`)",
                path.display(),
                pc.name,
                pc.slot
            ))
        })?;
        let view = st.tensor(full).map_err(err)?;
        let want = match (cols, pc.transpose) {
            (1, _) => vec![rows],
            (_, true) => vec![cols, rows],
            _ => vec![rows, cols],
        };
        if view.shape() != want.as_slice() {
            return Err(Error::Other(format!(
                "{OP}: {}: `{}` is {:?}, this model needs {want:?}",
                path.display(),
                pc.name,
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
                    "{OP}: {}: `{}` has dtype {other:?}",
                    path.display(),
                    pc.name
                )))
            }
        };
        let v = if pc.transpose && cols > 1 {
            transpose(&v, cols, rows)
        } else {
            v
        };
        weights[off + pc.rows.start * cols..off + pc.rows.end * cols].copy_from_slice(&v);
    }
    Ok(())
}
