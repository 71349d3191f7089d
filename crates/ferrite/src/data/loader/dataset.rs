//! The shards a loader reads: opened, their headers validated (against the index when there is
//! one), numbered into samples shard after shard.

use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::data::format::{self, read_header, Index, ShardHeader, INDEX_FILE};
use crate::data::order::mix64;
use std::path::{Path, PathBuf};

/// One opened, validated shard.
#[derive(Clone, Debug)]
pub struct ShardMeta {
    /// The shard's file.
    pub path: PathBuf,
    /// Its validated header.
    pub header: ShardHeader,
    /// The file's size (header plus payload).
    pub file_bytes: u64,
    /// Per-chunk CRC-32 from the index (None: no index, payload not verifiable).
    pub chunk_crc32: Option<Vec<u32>>,
}

/// A set of shards, in order.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// The shards, in sample-numbering order.
    pub shards: Vec<ShardMeta>,
    /// Chunk size of the checksums (0 when there is no index).
    pub chunk_bytes: u64,
    /// The index the dataset was opened from, if any.
    pub index: Option<Index>,
}

fn is_shard_name(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("bin") | Some("ftok")
    )
}

impl Dataset {
    /// Opens a folder (its `index.json`, else its `*.bin` / `*.ftok` files in name order), an
    /// `index.json`, or one shard file. Every header is read and validated now; with an index,
    /// each header must agree with its entry.
    pub fn open(path: &Path) -> Result<Dataset> {
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::io(format!("dataset {}: cannot open", path.display()), e))?;
        if meta.is_dir() {
            let idx = path.join(INDEX_FILE);
            if idx.exists() {
                return Self::from_index(&idx);
            }
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::io(format!("dataset {}: cannot list", path.display()), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_shard_name(p))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(Error::Other(format!(
                    "dataset {}: no {INDEX_FILE}, .bin or .ftok files",
                    path.display()
                )));
            }
            return Self::from_paths(&files);
        }
        if path.file_name().is_some_and(|n| n == INDEX_FILE)
            || path.extension().is_some_and(|e| e == "json")
        {
            return Self::from_index(path);
        }
        Self::from_paths(&[path.to_path_buf()])
    }

    /// Shards without an index: headers are validated, and a shard whose header carries a payload
    /// checksum (ferrite's `.ftok`) is read once here and checked against it — the loader's chunk
    /// checks need an index, and bad bytes must never reach training silently. llm.c shards have
    /// no checksum to check.
    pub fn from_paths(paths: &[PathBuf]) -> Result<Dataset> {
        let shards = paths
            .iter()
            .map(|p| {
                let header = read_header(p)?;
                format::verify_payload(p, &header)?;
                Ok(ShardMeta {
                    path: p.clone(),
                    file_bytes: header.payload_offset + header.payload_bytes(),
                    header,
                    chunk_crc32: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if shards.is_empty() {
            return Err(Error::Other("dataset: no shards given".into()));
        }
        Ok(Dataset {
            shards,
            chunk_bytes: 0,
            index: None,
        })
    }

    /// The shards an `index.json` lists, each header checked against its entry.
    pub fn from_index(index_path: &Path) -> Result<Dataset> {
        let idx = Index::read(index_path)?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut shards = Vec::with_capacity(idx.shards.len());
        for e in &idx.shards {
            let p = dir.join(&e.file);
            let header = read_header(&p)?;
            let bytes = header.payload_offset + header.payload_bytes();
            format::check_entry(&p, &header, e, bytes, idx.chunk_bytes)?;
            shards.push(ShardMeta {
                path: p,
                header,
                file_bytes: bytes,
                chunk_crc32: Some(e.chunk_crc32.clone()),
            });
        }
        Ok(Dataset {
            shards,
            chunk_bytes: idx.chunk_bytes,
            index: Some(idx),
        })
    }

    /// Tokens over all shards.
    pub fn total_tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.header.tokens).sum()
    }
    /// File bytes over all shards.
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.file_bytes).sum()
    }
    /// Whether reads can be verified (an index with chunk checksums).
    pub fn checksummed(&self) -> bool {
        self.chunk_bytes > 0
    }
    /// The widest token dtype of the shards.
    pub fn dtype(&self) -> DType {
        if self.shards.iter().any(|s| s.header.dtype == DType::U32) {
            DType::U32
        } else {
            DType::U16
        }
    }
    /// Samples of length T+1 per shard.
    pub fn samples_per_shard(&self, seq: u64) -> Vec<u64> {
        self.shards
            .iter()
            .map(|s| {
                if s.header.tokens > seq {
                    (s.header.tokens - 1) / seq
                } else {
                    0
                }
            })
            .collect()
    }
    /// A hash of what the shards hold (names, formats, counts, checksums).
    pub fn fingerprint(&self) -> u64 {
        let mut h = 0x243f_6a88_85a3_08d3u64;
        for s in &self.shards {
            let name = s
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            h = mix64(h ^ crc32fast::hash(name.as_bytes()) as u64);
            h = mix64(h ^ s.header.tokens ^ ((s.header.dtype.size_in_bytes() as u64) << 56));
            if let Some(c) = &s.chunk_crc32 {
                h = mix64(h ^ crc32fast::hash(bytemuck::cast_slice(c)) as u64);
            }
        }
        h
    }
    /// One line per dataset: shards, tokens, and what a given T leaves unused.
    pub fn summary(&self, seq: Option<u64>) -> String {
        let mut s = format!(
            "{} shards, {} tokens ({}), {:.1} MB, {}",
            self.shards.len(),
            self.total_tokens(),
            self.dtype(),
            self.total_bytes() as f64 / 1e6,
            if self.checksummed() {
                format!("checksummed in {} KiB chunks", self.chunk_bytes / 1024)
            } else {
                "no index: headers checked, payload not verifiable".into()
            }
        );
        if let Some(t) = seq {
            let samples: u64 = self.samples_per_shard(t).iter().sum();
            let unused = self.total_tokens() - samples * t - self.shards.len() as u64;
            s.push_str(&format!(
                "; T={t}: {samples} samples, {unused} tail tokens unused"
            ));
        }
        s
    }
}
