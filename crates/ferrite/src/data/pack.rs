//! Packing text into token shards with the GPT-2 BPE (`tiktoken-rs`'s `r50k_base`, whose
//! vocabulary is compiled into the binary: nothing is downloaded at run time).
//!
//! Each document is preceded by the end-of-text token (50256), as llm.c's packers do, so a model
//! sees document boundaries. A document is a whole text file, or one line of a `.jsonl` file (its
//! `"text"` field). Shards are filled to `shard_tokens` and written in order; an `index.json` with
//! every shard's dtype, count and checksums is written last (atomically).

#[cfg(feature = "pack")]
use super::format::IndexEntry;
use super::format::{Index, ShardFormat, ShardWriter, INDEX_FILE, INDEX_FORMAT, INDEX_VERSION};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
#[cfg(feature = "pack")]
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// GPT-2's `<|endoftext|>`, written before every document.
pub const GPT2_EOT: u32 = 50256;
/// GPT-2's vocabulary size.
pub const GPT2_VOCAB: u32 = 50257;

/// Where and how to write shards. `Default`: `.ftok` shards of 100 M u16 tokens in `data/`,
/// 64 KiB checksum chunks.
#[derive(Clone, Debug)]
pub struct PackConfig {
    /// The folder the shards and `index.json` go to (its previous corpus replaced only once
    /// every input has packed).
    pub out_dir: PathBuf,
    /// The shard format.
    pub format: ShardFormat,
    /// U16 (GPT-2 fits) or U32.
    pub dtype: DType,
    /// Tokens per shard (the last one holds the rest).
    pub shard_tokens: u64,
    /// Payload bytes per checksum chunk (a multiple of 4096).
    pub chunk_bytes: u64,
    /// Shard file name prefix: `{prefix}_{NNNNNN}.{ftok|bin}`.
    pub prefix: String,
}

impl Default for PackConfig {
    fn default() -> Self {
        PackConfig {
            out_dir: PathBuf::from("data"),
            format: ShardFormat::Ferrite,
            dtype: DType::U16,
            shard_tokens: 100_000_000,
            chunk_bytes: super::format::DEFAULT_CHUNK_BYTES,
            prefix: "shard".into(),
        }
    }
}

/// What a pack did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PackSummary {
    /// Input files read.
    pub files: usize,
    /// Documents tokenized.
    pub documents: u64,
    /// Bytes of input text.
    pub input_bytes: u64,
    /// Tokens written (end-of-text tokens included).
    pub tokens: u64,
    /// Shards written.
    pub shards: usize,
    /// Wall time.
    pub seconds: f64,
    /// The index written.
    pub index: PathBuf,
}

/// Progress: (input bytes done, input bytes total, tokens so far).
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64, u64);

/// The GPT-2 tokenizer (built once per call; ~0.2 s). Feature `pack`.
#[cfg(feature = "pack")]
pub fn gpt2() -> Result<tiktoken_rs::CoreBPE> {
    tiktoken_rs::r50k_base().map_err(|e| Error::Other(format!("loading the GPT-2 BPE: {e}")))
}

/// The documents of one input file.
#[cfg(feature = "pack")]
fn documents(path: &Path) -> Result<Vec<String>> {
    let bytes = std::fs::read(path)
        .map_err(|e| Error::io(format!("input {}: cannot read", path.display()), e))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::Other(format!(
            "input {}: at byte {}: not UTF-8",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    if path.extension().is_some_and(|e| e == "jsonl") {
        let mut docs = Vec::new();
        let mut at = 0usize;
        for (n, line) in text.split_inclusive('\n').enumerate() {
            let l = line.trim();
            if !l.is_empty() {
                let v: serde_json::Value = serde_json::from_str(l).map_err(|e| {
                    Error::Other(format!(
                        "input {}: line {} (byte {at}): {e}",
                        path.display(),
                        n + 1
                    ))
                })?;
                let t = v.get("text").and_then(|t| t.as_str()).ok_or_else(|| {
                    Error::Other(format!(
                        "input {}: line {} (byte {at}): no string field \"text\"",
                        path.display(),
                        n + 1
                    ))
                })?;
                docs.push(t.to_string());
            }
            at += line.len();
        }
        Ok(docs)
    } else {
        Ok(vec![text])
    }
}

/// Tokenizes `files` (in order) into shards under `cfg.out_dir`. The shards are written into a
/// staging folder inside it and moved in only when every input has been packed, then the index
/// is replaced and the previous corpus's shards that the new one did not overwrite are removed:
/// a pack that fails midway leaves the folder as it was. Feature `pack`.
#[cfg(feature = "pack")]
pub fn pack_files(files: &[PathBuf], cfg: &PackConfig, progress: Progress) -> Result<PackSummary> {
    std::fs::create_dir_all(&cfg.out_dir)
        .map_err(|e| Error::io(format!("creating {}", cfg.out_dir.display()), e))?;
    let stage = cfg
        .out_dir
        .join(format!(".ferrite-pack-staging-{}", std::process::id()));
    std::fs::create_dir_all(&stage)
        .map_err(|e| Error::io(format!("creating {}", stage.display()), e))?;
    let r = pack_into(files, cfg, &stage, progress).and_then(|s| commit(cfg, &stage, s));
    let _ = std::fs::remove_dir_all(&stage);
    r
}

/// Moves the staged shards into the output folder, writes the new index over the old one and
/// removes the old corpus's shards the new one did not replace.
#[cfg(feature = "pack")]
fn commit(
    cfg: &PackConfig,
    stage: &Path,
    (summary, index): (PackSummary, Index),
) -> Result<PackSummary> {
    let old: Vec<String> = Index::read(&cfg.out_dir.join(INDEX_FILE))
        .map(|i| i.shards.into_iter().map(|e| e.file).collect())
        .unwrap_or_default();
    for e in &index.shards {
        let (from, to) = (stage.join(&e.file), cfg.out_dir.join(&e.file));
        std::fs::rename(&from, &to).map_err(|err| {
            Error::io(
                format!("moving {} to {}", from.display(), to.display()),
                err,
            )
        })?;
    }
    index.write(&summary.index)?;
    for f in old
        .iter()
        .filter(|f| !index.shards.iter().any(|e| &e.file == *f))
    {
        let _ = std::fs::remove_file(cfg.out_dir.join(f));
    }
    Ok(summary)
}

#[cfg(feature = "pack")]
fn pack_into(
    files: &[PathBuf],
    cfg: &PackConfig,
    stage: &Path,
    progress: Progress,
) -> Result<(PackSummary, Index)> {
    let t0 = std::time::Instant::now();
    if files.is_empty() {
        return Err(Error::bad_arg(
            "data pack",
            "inputs",
            "at least one text file",
            "none",
        ));
    }
    if cfg.shard_tokens == 0 {
        return Err(Error::bad_arg("data pack", "shard_tokens", "≥ 1", 0));
    }
    let dtype = match cfg.format {
        ShardFormat::LlmcV1 => DType::U16,
        ShardFormat::LlmcV7 => DType::U32,
        ShardFormat::Ferrite => cfg.dtype,
    };
    let sizes: Vec<u64> = files
        .iter()
        .map(|f| {
            std::fs::metadata(f)
                .map(|m| m.len())
                .map_err(|e| Error::io(format!("input {}: cannot open", f.display()), e))
        })
        .collect::<Result<_>>()?;
    let total: u64 = sizes.iter().sum();
    let bpe = gpt2()?;
    let ext = if cfg.format == ShardFormat::Ferrite {
        "ftok"
    } else {
        "bin"
    };
    let mut entries: Vec<IndexEntry> = Vec::new();
    let mut writer: Option<ShardWriter> = None;
    let (mut done_bytes, mut tokens, mut documents_n) = (0u64, 0u64, 0u64);
    // Tokenize a group of files in parallel (order kept), then write them in order.
    let group = rayon::current_num_threads().max(1) * 2;
    for (gi, chunk) in files.chunks(group).enumerate() {
        let toks: Vec<Result<Vec<Vec<u32>>>> = chunk
            .par_iter()
            .map(|f| {
                Ok(documents(f)?
                    .iter()
                    .map(|d| {
                        let mut v = Vec::with_capacity(d.len() / 3 + 1);
                        v.push(GPT2_EOT);
                        v.extend(bpe.encode_ordinary(d));
                        v
                    })
                    .collect())
            })
            .collect();
        for (fi, docs) in toks.into_iter().enumerate() {
            for doc in docs? {
                documents_n += 1;
                let mut rest = &doc[..];
                let mut first = true;
                while !rest.is_empty() {
                    if writer.is_none() {
                        let p = stage.join(format!("{}_{:06}.{ext}", cfg.prefix, entries.len()));
                        writer = Some(ShardWriter::create(
                            &p,
                            cfg.format,
                            dtype,
                            cfg.chunk_bytes,
                            GPT2_VOCAB,
                        )?);
                    }
                    let w = writer.as_mut().unwrap();
                    if first {
                        w.documents += 1;
                        first = false;
                    }
                    let take = ((cfg.shard_tokens - w.tokens()) as usize).min(rest.len());
                    w.push(&rest[..take])?;
                    rest = &rest[take..];
                    tokens += take as u64;
                    if w.tokens() == cfg.shard_tokens {
                        entries.push(writer.take().unwrap().finish()?);
                    }
                }
            }
            done_bytes += sizes[gi * group + fi];
            progress(done_bytes, total, tokens);
        }
    }
    if let Some(w) = writer.take() {
        if w.tokens() > 0 {
            entries.push(w.finish()?);
        }
    }
    let index = Index {
        format: INDEX_FORMAT.into(),
        version: INDEX_VERSION,
        tokenizer: "gpt2 (tiktoken r50k_base)".into(),
        vocab_size: GPT2_VOCAB,
        eot_token: Some(GPT2_EOT),
        chunk_bytes: cfg.chunk_bytes,
        total_tokens: tokens,
        shards: entries,
    };
    let summary = PackSummary {
        files: files.len(),
        documents: documents_n,
        input_bytes: total,
        tokens,
        shards: index.shards.len(),
        seconds: t0.elapsed().as_secs_f64(),
        index: cfg.out_dir.join(INDEX_FILE),
    };
    Ok((summary, index))
}

/// Writes token arrays as shards plus an index (tests and synthetic benchmarks use this).
pub fn write_shards(
    dir: &Path,
    format: ShardFormat,
    dtype: DType,
    chunk_bytes: u64,
    shards: &[Vec<u32>],
    vocab: u32,
) -> Result<Index> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let ext = if format == ShardFormat::Ferrite {
        "ftok"
    } else {
        "bin"
    };
    let mut entries = Vec::new();
    for (i, toks) in shards.iter().enumerate() {
        let mut w = ShardWriter::create(
            &dir.join(format!("shard_{i:06}.{ext}")),
            format,
            dtype,
            chunk_bytes,
            vocab,
        )?;
        w.push(toks)?;
        entries.push(w.finish()?);
    }
    let index = Index {
        format: INDEX_FORMAT.into(),
        version: INDEX_VERSION,
        tokenizer: "none".into(),
        vocab_size: vocab,
        eot_token: None,
        chunk_bytes,
        total_tokens: shards.iter().map(|s| s.len() as u64).sum(),
        shards: entries,
    };
    index.write(&dir.join(INDEX_FILE))?;
    Ok(index)
}
