//! Token shard formats: llm.c's `.bin` (v1 u16, v7 u32) and ferrite's own `.ftok`, plus the
//! index file (`index.json`) that records, per shard, its dtype, token count and checksums.
//!
//! Layouts (all integers little-endian):
//!
//! - llm.c: 256 × i32 header (1024 bytes): `[0]` magic, `[1]` version, `[2]` token count, the rest
//!   zero; tokens follow at byte 1024. Magic 20240520 / version 1 stores u16 tokens, magic
//!   20240801 / version 7 stores u32 tokens. The format has no checksum: its payload can only be
//!   verified against an index written by `ferrite data pack` (or `inspect --write-index`).
//! - ferrite (`.ftok`): a 4096-byte header (so the payload starts on an O_DIRECT boundary):
//!   `0..8` magic `FERRTOK\0`, `8..12` version 1, `12..16` bytes per token (2 or 4), `16..24` token
//!   count, `24..28` checksum chunk size, `28..32` CRC-32 of the payload, `32..36` vocabulary size
//!   (0 = unknown), `36..40` reserved, `40..48` payload offset (4096), `48..4092` reserved (zero),
//!   `4092..4096` CRC-32 of bytes `0..4092`. Tokens follow at byte 4096.
//!
//! Every check names the shard file and the byte offset of what failed.

use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Magic of llm.c's version-1 shards (u16 tokens).
pub const LLMC_MAGIC_V1: i32 = 20240520;
/// Magic of llm.c's version-7 shards (u32 tokens).
pub const LLMC_MAGIC_V7: i32 = 20240801;
/// llm.c's header size: 256 i32 fields.
pub const LLMC_HEADER_BYTES: u64 = 1024;
/// The first eight bytes of a `.ftok` shard.
pub const FTOK_MAGIC: &[u8; 8] = b"FERRTOK\0";
/// The `.ftok` version this code reads and writes.
pub const FTOK_VERSION: u32 = 1;
/// `.ftok` header size: one O_DIRECT block, so the payload starts aligned.
pub const FTOK_HEADER_BYTES: u64 = 4096;
/// The index file a packed directory carries.
pub const INDEX_FILE: &str = "index.json";
/// The `format` field of `index.json`.
pub const INDEX_FORMAT: &str = "ferrite-token-index";
/// The index version this code reads and writes.
pub const INDEX_VERSION: u32 = 1;
/// Payload checksum granularity: every read of a chunk can be verified on its own, so the loader
/// checks each byte it reads without reading whole shards. A multiple of 4096 (O_DIRECT). Small
/// enough that widening a block's reads to whole chunks costs little (≤ 2 chunks per 4 MiB
/// block), large enough that the index stays small (16 checksums per MiB).
pub const DEFAULT_CHUNK_BYTES: u64 = 64 << 10;

/// An error about one shard at one byte offset (the form every data error takes).
pub fn shard_error(path: &Path, offset: u64, msg: impl std::fmt::Display) -> Error {
    Error::Other(format!("shard {}: at byte {offset}: {msg}", path.display()))
}

pub(crate) fn io_error(path: &Path, offset: u64, what: &str, e: std::io::Error) -> Error {
    Error::io(
        format!("shard {}: at byte {offset}: {what}", path.display()),
        e,
    )
}

/// The file format of one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardFormat {
    /// llm.c, magic 20240520 version 1, u16 tokens.
    LlmcV1,
    /// llm.c, magic 20240801 version 7, u32 tokens.
    LlmcV7,
    /// ferrite's own `.ftok`.
    Ferrite,
}

impl ShardFormat {
    /// `llmc-v1`, `llmc-v7` or `ferrite`, as `data inspect` prints it.
    pub fn name(self) -> &'static str {
        match self {
            ShardFormat::LlmcV1 => "llmc-v1",
            ShardFormat::LlmcV7 => "llmc-v7",
            ShardFormat::Ferrite => "ferrite",
        }
    }
    /// Bytes before the first token.
    pub fn header_bytes(self) -> u64 {
        match self {
            ShardFormat::Ferrite => FTOK_HEADER_BYTES,
            _ => LLMC_HEADER_BYTES,
        }
    }
}

/// Token dtype of a shard: u16 or u32 only.
pub fn token_dtype(bytes_per_token: u64) -> Option<DType> {
    match bytes_per_token {
        2 => Some(DType::U16),
        4 => Some(DType::U32),
        _ => None,
    }
}

/// What a shard's header says, validated against the file's size.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardHeader {
    /// The file's format.
    pub format: ShardFormat,
    /// The token type: u16 or u32.
    pub dtype: DType,
    /// Tokens in the payload (≥ 1).
    pub tokens: u64,
    /// Byte offset of the first token.
    pub payload_offset: u64,
    /// ferrite only: CRC-32 of the payload.
    pub payload_crc32: Option<u32>,
    /// ferrite only: the vocabulary size (0 = unknown or llm.c).
    pub vocab_size: u32,
    /// ferrite only: the checksum chunk size the shard was written with (0 for llm.c).
    pub chunk_bytes: u64,
}

impl ShardHeader {
    /// Bytes of token data.
    pub fn payload_bytes(&self) -> u64 {
        self.tokens * self.dtype.size_in_bytes() as u64
    }
}

fn le_i32(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Parses and validates a header. `head` holds the file's first bytes (up to 4096);
/// `file_bytes` is the file's size. Never panics on any input.
pub fn parse_header(path: &Path, head: &[u8], file_bytes: u64) -> Result<ShardHeader> {
    if file_bytes == 0 {
        return Err(shard_error(path, 0, "empty file (no header)"));
    }
    if head.len() >= 8 && &head[..8] == FTOK_MAGIC {
        return parse_ftok(path, head, file_bytes);
    }
    if head.len() < 8 {
        return Err(shard_error(
            path,
            head.len() as u64,
            format!(
                "truncated header: file is {file_bytes} bytes, a header needs {LLMC_HEADER_BYTES}"
            ),
        ));
    }
    let magic = le_i32(head, 0);
    let version = le_i32(head, 4);
    let (format, want_version) = match magic {
        LLMC_MAGIC_V1 => (ShardFormat::LlmcV1, 1),
        LLMC_MAGIC_V7 => (ShardFormat::LlmcV7, 7),
        _ => {
            return Err(shard_error(
                path,
                0,
                format!(
                    "bad magic {magic} (0x{:08x}): expected {LLMC_MAGIC_V1} (llm.c v1), {LLMC_MAGIC_V7} \
                     (llm.c v7) or \"FERRTOK\" (ferrite)",
                    magic as u32
                ),
            ))
        }
    };
    if version != want_version {
        return Err(shard_error(
            path,
            4,
            format!("bad version {version}: magic {magic} goes with version {want_version}"),
        ));
    }
    if (head.len() as u64) < LLMC_HEADER_BYTES {
        return Err(shard_error(
            path,
            head.len() as u64,
            format!("truncated header: file is {file_bytes} bytes, the llm.c header alone is {LLMC_HEADER_BYTES}"),
        ));
    }
    let count = le_i32(head, 8);
    if count <= 0 {
        let what = if count == 0 {
            "empty shard (token count 0)".to_string()
        } else {
            format!("negative token count {count}")
        };
        return Err(shard_error(path, 8, what));
    }
    // llm.c writes zeros after the three fields; anything else there is corruption.
    if let Some(i) = (12..LLMC_HEADER_BYTES as usize).find(|&i| head[i] != 0) {
        return Err(shard_error(
            path,
            i as u64,
            format!(
                "reserved header byte is 0x{:02x}, llm.c writes 0 (corrupt header)",
                head[i]
            ),
        ));
    }
    let dtype = if format == ShardFormat::LlmcV1 {
        DType::U16
    } else {
        DType::U32
    };
    let h = ShardHeader {
        format,
        dtype,
        tokens: count as u64,
        payload_offset: LLMC_HEADER_BYTES,
        payload_crc32: None,
        vocab_size: 0,
        chunk_bytes: 0,
    };
    check_size(path, &h, file_bytes, 8)?;
    Ok(h)
}

fn check_size(path: &Path, h: &ShardHeader, file_bytes: u64, count_at: u64) -> Result<()> {
    let want = h.payload_offset + h.payload_bytes();
    if file_bytes < want {
        return Err(shard_error(
            path,
            file_bytes,
            format!(
                "truncated: the header (count at byte {count_at}) says {} tokens = {want} bytes, the file ends at {file_bytes}",
                h.tokens
            ),
        ));
    }
    if file_bytes > want {
        return Err(shard_error(
            path,
            want,
            format!(
                "token count mismatch: the header (count at byte {count_at}) says {} tokens ending at byte {want}, \
                 but the file is {file_bytes} bytes",
                h.tokens
            ),
        ));
    }
    Ok(())
}

fn parse_ftok(path: &Path, head: &[u8], file_bytes: u64) -> Result<ShardHeader> {
    if (head.len() as u64) < FTOK_HEADER_BYTES {
        return Err(shard_error(
            path,
            head.len() as u64,
            format!("truncated header: file is {file_bytes} bytes, the ferrite header alone is {FTOK_HEADER_BYTES}"),
        ));
    }
    let version = le_u32(head, 8);
    if version != FTOK_VERSION {
        return Err(shard_error(
            path,
            8,
            format!(
                "bad version {version}: this reader knows ferrite shard version {FTOK_VERSION}"
            ),
        ));
    }
    let stored = le_u32(head, 4092);
    let actual = crc32fast::hash(&head[..4092]);
    if stored != actual {
        return Err(shard_error(
            path,
            4092,
            format!("header checksum mismatch (stored 0x{stored:08x}, bytes 0..4092 hash to 0x{actual:08x}): corrupt header"),
        ));
    }
    let bpt = le_u32(head, 12) as u64;
    let dtype = token_dtype(bpt)
        .ok_or_else(|| shard_error(path, 12, format!("bad bytes-per-token {bpt} (2 or 4)")))?;
    let tokens = le_u64(head, 16);
    if tokens == 0 {
        return Err(shard_error(path, 16, "empty shard (token count 0)"));
    }
    let chunk_bytes = le_u32(head, 24) as u64;
    if chunk_bytes == 0 || !chunk_bytes.is_multiple_of(4096) {
        return Err(shard_error(
            path,
            24,
            format!("bad chunk size {chunk_bytes} (a positive multiple of 4096)"),
        ));
    }
    let payload_offset = le_u64(head, 40);
    if payload_offset != FTOK_HEADER_BYTES {
        return Err(shard_error(
            path,
            40,
            format!("bad payload offset {payload_offset} (4096)"),
        ));
    }
    if let Some(i) = (36..40).chain(48..4092).find(|&i| head[i] != 0) {
        return Err(shard_error(
            path,
            i as u64,
            format!("reserved header byte is 0x{:02x}, expected 0", head[i]),
        ));
    }
    let h = ShardHeader {
        format: ShardFormat::Ferrite,
        dtype,
        tokens,
        payload_offset,
        payload_crc32: Some(le_u32(head, 28)),
        vocab_size: le_u32(head, 32),
        chunk_bytes,
    };
    tokens
        .checked_mul(bpt)
        .and_then(|b| b.checked_add(payload_offset))
        .ok_or_else(|| shard_error(path, 16, format!("token count {tokens} overflows")))?;
    check_size(path, &h, file_bytes, 16)?;
    Ok(h)
}

/// Reads and validates the header of the shard at `path`.
pub fn read_header(path: &Path) -> Result<ShardHeader> {
    let mut f = std::fs::File::open(path).map_err(|e| io_error(path, 0, "cannot open", e))?;
    let len = f
        .metadata()
        .map_err(|e| io_error(path, 0, "cannot stat", e))?
        .len();
    if !f.metadata().map(|m| m.is_file()).unwrap_or(false) {
        return Err(shard_error(path, 0, "not a regular file"));
    }
    let mut head = vec![0u8; FTOK_HEADER_BYTES.min(len) as usize];
    f.read_exact(&mut head)
        .map_err(|e| io_error(path, 0, "cannot read header", e))?;
    parse_header(path, &head, len)
}

/// Builds the header bytes of a shard.
pub fn encode_header(
    format: ShardFormat,
    tokens: u64,
    payload_crc32: u32,
    vocab_size: u32,
    chunk_bytes: u64,
) -> Vec<u8> {
    match format {
        ShardFormat::LlmcV1 | ShardFormat::LlmcV7 => {
            let mut h = vec![0u8; LLMC_HEADER_BYTES as usize];
            let (m, v): (i32, i32) = if format == ShardFormat::LlmcV1 {
                (LLMC_MAGIC_V1, 1)
            } else {
                (LLMC_MAGIC_V7, 7)
            };
            h[0..4].copy_from_slice(&m.to_le_bytes());
            h[4..8].copy_from_slice(&v.to_le_bytes());
            h[8..12].copy_from_slice(&(tokens as i32).to_le_bytes());
            h
        }
        ShardFormat::Ferrite => {
            let mut h = vec![0u8; FTOK_HEADER_BYTES as usize];
            h[0..8].copy_from_slice(FTOK_MAGIC);
            h[8..12].copy_from_slice(&FTOK_VERSION.to_le_bytes());
            let bpt: u32 = 2; // patched by the caller for u32 via `encode_ftok_header`
            h[12..16].copy_from_slice(&bpt.to_le_bytes());
            h[16..24].copy_from_slice(&tokens.to_le_bytes());
            h[24..28].copy_from_slice(&(chunk_bytes as u32).to_le_bytes());
            h[28..32].copy_from_slice(&payload_crc32.to_le_bytes());
            h[32..36].copy_from_slice(&vocab_size.to_le_bytes());
            h[40..48].copy_from_slice(&FTOK_HEADER_BYTES.to_le_bytes());
            let c = crc32fast::hash(&h[..4092]);
            h[4092..].copy_from_slice(&c.to_le_bytes());
            h
        }
    }
}

/// The ferrite header for `dtype` tokens (2 or 4 bytes each).
pub fn encode_ftok_header(
    dtype: DType,
    tokens: u64,
    payload_crc32: u32,
    vocab_size: u32,
    chunk_bytes: u64,
) -> Vec<u8> {
    let mut h = encode_header(
        ShardFormat::Ferrite,
        tokens,
        payload_crc32,
        vocab_size,
        chunk_bytes,
    );
    h[12..16].copy_from_slice(&(dtype.size_in_bytes() as u32).to_le_bytes());
    let c = crc32fast::hash(&h[..4092]);
    h[4092..].copy_from_slice(&c.to_le_bytes());
    h
}

/// One shard as the index records it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct IndexEntry {
    /// File name relative to the index's folder.
    pub file: String,
    /// The shard's format.
    pub format: ShardFormat,
    /// "u16" or "u32".
    pub dtype: String,
    /// Tokens in the shard.
    pub tokens: u64,
    /// The file's size.
    pub bytes: u64,
    /// Byte offset of the first token.
    pub payload_offset: u64,
    /// CRC-32 (IEEE) of the whole payload.
    pub crc32: u32,
    /// CRC-32 of each `chunk_bytes` piece of the payload (the last one may be shorter).
    pub chunk_crc32: Vec<u32>,
    /// Documents that start in this shard (informational).
    #[serde(default)]
    pub documents: u64,
}

/// `index.json`: the shards of a packed corpus, in order, with what is needed to verify them.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Index {
    /// Always [`INDEX_FORMAT`].
    pub format: String,
    /// Always [`INDEX_VERSION`] for files this code writes.
    pub version: u32,
    /// The tokenizer that produced the tokens, in words (`gpt2 (tiktoken r50k_base)`).
    pub tokenizer: String,
    /// Token ids are below this.
    pub vocab_size: u32,
    /// The end-of-text token separating documents, if the packer inserted one.
    pub eot_token: Option<u32>,
    /// Payload bytes per checksum chunk.
    pub chunk_bytes: u64,
    /// Tokens over all shards.
    pub total_tokens: u64,
    /// The shards, in order.
    pub shards: Vec<IndexEntry>,
}

impl Index {
    /// Reads and checks an index (format, version, totals): an error names the file and what
    /// is wrong.
    pub fn read(path: &Path) -> Result<Index> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("index {}: cannot read", path.display()), e))?;
        let idx: Index = serde_json::from_str(&text).map_err(|e| {
            Error::Other(format!(
                "index {}: line {} column {}: {e}",
                path.display(),
                e.line(),
                e.column()
            ))
        })?;
        if idx.format != INDEX_FORMAT || idx.version != INDEX_VERSION {
            return Err(Error::Other(format!(
                "index {}: format {:?} version {} (expected {INDEX_FORMAT:?} version {INDEX_VERSION})",
                path.display(),
                idx.format,
                idx.version
            )));
        }
        if idx.chunk_bytes == 0 || !idx.chunk_bytes.is_multiple_of(4096) {
            return Err(Error::Other(format!(
                "index {}: chunk_bytes {} is not a positive multiple of 4096",
                path.display(),
                idx.chunk_bytes
            )));
        }
        if idx.shards.is_empty() {
            return Err(Error::Other(format!(
                "index {}: lists no shards",
                path.display()
            )));
        }
        let sum = idx
            .shards
            .iter()
            .try_fold(0u64, |a, s| a.checked_add(s.tokens))
            .ok_or_else(|| {
                Error::Other(format!(
                    "index {}: the shards' token counts add up to more than 2^64",
                    path.display()
                ))
            })?;
        if sum != idx.total_tokens {
            return Err(Error::Other(format!(
                "index {}: total_tokens {} but the shards add up to {sum}",
                path.display(),
                idx.total_tokens
            )));
        }
        Ok(idx)
    }

    /// Writes the index as pretty JSON, atomically (temporary file, then rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        let s = serde_json::to_string_pretty(self).map_err(|e| Error::Other(e.to_string()))?;
        write_atomic(path, s.as_bytes())
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a crash never leaves a
/// half-written file under the final name.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    let mut f = std::fs::File::create(&tmp)
        .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    f.write_all(bytes)
        .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    f.sync_all()
        .map_err(|e| Error::io(format!("syncing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        Error::io(
            format!("renaming {} to {}", tmp.display(), path.display()),
            e,
        )
    })
}

pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// CRC-32 of each `chunk` bytes of `payload`.
pub fn chunk_crcs(payload: &[u8], chunk: u64) -> Vec<u32> {
    payload
        .chunks(chunk as usize)
        .map(crc32fast::hash)
        .collect()
}

/// Streams a shard file into place: header placeholder, tokens, then the real header; keeps the
/// payload and per-chunk checksums as it goes. The file appears under its name only when finished.
pub struct ShardWriter {
    path: PathBuf,
    tmp: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    format: ShardFormat,
    dtype: DType,
    tokens: u64,
    chunk_bytes: u64,
    vocab_size: u32,
    whole: crc32fast::Hasher,
    chunk: crc32fast::Hasher,
    in_chunk: u64,
    chunk_crcs: Vec<u32>,
    scratch: Vec<u8>,
    /// Documents started in this shard (the packer counts them; recorded in the index).
    pub documents: u64,
}

impl ShardWriter {
    /// Starts `path` (written as `path.tmp` until [`finish`](ShardWriter::finish)): the token
    /// dtype must be the format's (u16 for llm.c v1, u32 for v7, either for ferrite).
    pub fn create(
        path: &Path,
        format: ShardFormat,
        dtype: DType,
        chunk_bytes: u64,
        vocab_size: u32,
    ) -> Result<Self> {
        let want = match format {
            ShardFormat::LlmcV1 => DType::U16,
            ShardFormat::LlmcV7 => DType::U32,
            ShardFormat::Ferrite => dtype,
        };
        if dtype != want || !matches!(dtype, DType::U16 | DType::U32) {
            return Err(Error::bad_arg(
                "ShardWriter",
                "dtype",
                format!("{want} for {}", format.name()),
                dtype,
            ));
        }
        if chunk_bytes == 0 || !chunk_bytes.is_multiple_of(4096) || chunk_bytes > u32::MAX as u64 {
            return Err(Error::bad_arg(
                "ShardWriter",
                "chunk_bytes",
                "a multiple of 4096 below 4 GiB",
                chunk_bytes,
            ));
        }
        let tmp = tmp_path(path);
        let f = std::fs::File::create(&tmp)
            .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
        let mut file = std::io::BufWriter::with_capacity(1 << 20, f);
        file.write_all(&vec![0u8; format.header_bytes() as usize])
            .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
        Ok(ShardWriter {
            path: path.to_path_buf(),
            tmp,
            file,
            format,
            dtype,
            tokens: 0,
            chunk_bytes,
            vocab_size,
            whole: crc32fast::Hasher::new(),
            chunk: crc32fast::Hasher::new(),
            in_chunk: 0,
            chunk_crcs: Vec::new(),
            scratch: Vec::new(),
            documents: 0,
        })
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Appends tokens (each must fit the shard's dtype).
    pub fn push(&mut self, toks: &[u32]) -> Result<()> {
        if self.format != ShardFormat::Ferrite && self.tokens + toks.len() as u64 > i32::MAX as u64
        {
            return Err(Error::Other(format!(
                "shard {}: llm.c shards hold at most {} tokens (an i32 count)",
                self.path.display(),
                i32::MAX
            )));
        }
        self.scratch.clear();
        match self.dtype {
            DType::U16 => {
                for &t in toks {
                    let v = u16::try_from(t).map_err(|_| {
                        Error::Other(format!(
                            "shard {}: token {t} does not fit u16 (pack with --dtype u32)",
                            self.path.display()
                        ))
                    })?;
                    self.scratch.extend_from_slice(&v.to_le_bytes());
                }
            }
            _ => toks
                .iter()
                .for_each(|t| self.scratch.extend_from_slice(&t.to_le_bytes())),
        }
        // Feed the chunk hashers, splitting at chunk boundaries.
        let mut rest = &self.scratch[..];
        while !rest.is_empty() {
            let take = ((self.chunk_bytes - self.in_chunk) as usize).min(rest.len());
            self.chunk.update(&rest[..take]);
            self.in_chunk += take as u64;
            rest = &rest[take..];
            if self.in_chunk == self.chunk_bytes {
                let h = std::mem::replace(&mut self.chunk, crc32fast::Hasher::new());
                self.chunk_crcs.push(h.finalize());
                self.in_chunk = 0;
            }
        }
        self.whole.update(&self.scratch);
        self.file
            .write_all(&self.scratch)
            .map_err(|e| Error::io(format!("writing {}", self.tmp.display()), e))?;
        self.tokens += toks.len() as u64;
        Ok(())
    }

    /// Writes the header, syncs, renames into place and returns the index entry.
    pub fn finish(mut self) -> Result<IndexEntry> {
        let ctx = |what: &str| format!("{what} {}", self.tmp.display());
        if self.tokens == 0 {
            drop(self.file);
            let _ = std::fs::remove_file(&self.tmp);
            return Err(Error::Other(format!(
                "shard {}: no tokens to write",
                self.path.display()
            )));
        }
        if self.in_chunk > 0 {
            self.chunk_crcs.push(self.chunk.clone().finalize());
        }
        let crc = self.whole.clone().finalize();
        let header = match self.format {
            ShardFormat::Ferrite => encode_ftok_header(
                self.dtype,
                self.tokens,
                crc,
                self.vocab_size,
                self.chunk_bytes,
            ),
            f => encode_header(f, self.tokens, crc, self.vocab_size, self.chunk_bytes),
        };
        let mut f = self
            .file
            .into_inner()
            .map_err(|e| Error::io(ctx("flushing"), e.into_error()))?;
        f.seek(SeekFrom::Start(0))
            .map_err(|e| Error::io(ctx("seeking"), e))?;
        f.write_all(&header)
            .map_err(|e| Error::io(ctx("writing header of"), e))?;
        f.sync_all().map_err(|e| Error::io(ctx("syncing"), e))?;
        let bytes = f.metadata().map_err(|e| Error::io(ctx("stat"), e))?.len();
        drop(f);
        std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(ctx("renaming"), e))?;
        Ok(IndexEntry {
            file: self
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            format: self.format,
            dtype: self.dtype.name().into(),
            tokens: self.tokens,
            bytes,
            payload_offset: self.format.header_bytes(),
            crc32: crc,
            chunk_crc32: self.chunk_crcs,
            documents: self.documents,
        })
    }
}

/// Reads a whole shard and checks its header, its index entry (when given) and every payload
/// chunk. The error names the shard and the first failing chunk's byte range.
pub fn verify_shard(
    path: &Path,
    entry: Option<&IndexEntry>,
    chunk_bytes: u64,
) -> Result<ShardHeader> {
    let bytes = std::fs::read(path).map_err(|e| io_error(path, 0, "cannot read", e))?;
    verify_bytes(path, &bytes, entry, chunk_bytes)
}

/// `verify_shard` on a shard's bytes already in memory (`path` names it in errors).
pub fn verify_bytes(
    path: &Path,
    bytes: &[u8],
    entry: Option<&IndexEntry>,
    chunk_bytes: u64,
) -> Result<ShardHeader> {
    let head = &bytes[..bytes.len().min(FTOK_HEADER_BYTES as usize)];
    let h = parse_header(path, head, bytes.len() as u64)?;
    let payload = &bytes[h.payload_offset as usize..];
    if let Some(e) = entry {
        check_entry(path, &h, e, bytes.len() as u64, chunk_bytes)?;
        for (k, piece) in payload.chunks(chunk_bytes as usize).enumerate() {
            let got = crc32fast::hash(piece);
            if got != e.chunk_crc32[k] {
                let at = h.payload_offset + k as u64 * chunk_bytes;
                return Err(shard_error(
                    path,
                    at,
                    format!(
                        "checksum mismatch in payload bytes {at}..{} (chunk {k}: index 0x{:08x}, data 0x{got:08x})",
                        at + piece.len() as u64,
                        e.chunk_crc32[k]
                    ),
                ));
            }
        }
    }
    if let Some(c) = h.payload_crc32 {
        let got = crc32fast::hash(payload);
        if got != c {
            return Err(shard_error(
                path,
                h.payload_offset,
                format!(
                    "payload checksum mismatch (header at byte 28: 0x{c:08x}, data 0x{got:08x})"
                ),
            ));
        }
    }
    Ok(h)
}

/// Reads a shard's payload once, streaming, and checks it against the header's payload checksum
/// (nothing to do for formats without one).
pub fn verify_payload(path: &Path, h: &ShardHeader) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let Some(want) = h.payload_crc32 else {
        return Ok(());
    };
    let mut f = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("shard {}: cannot open", path.display()), e))?;
    f.seek(SeekFrom::Start(h.payload_offset)).map_err(|e| {
        Error::io(
            format!("shard {}: seeking to the payload", path.display()),
            e,
        )
    })?;
    let mut left = h.payload_bytes();
    let mut buf = vec![0u8; (8 << 20).min(left.max(1) as usize)];
    let mut crc = crc32fast::Hasher::new();
    while left > 0 {
        let n = (buf.len() as u64).min(left) as usize;
        f.read_exact(&mut buf[..n])
            .map_err(|e| Error::io(format!("shard {}: reading the payload", path.display()), e))?;
        crc.update(&buf[..n]);
        left -= n as u64;
    }
    let got = crc.finalize();
    if got != want {
        return Err(shard_error(
            path,
            h.payload_offset,
            format!(
                "payload checksum mismatch (header at byte 28: 0x{want:08x}, data 0x{got:08x})"
            ),
        ));
    }
    Ok(())
}

/// Checks that the header agrees with the index entry.
pub fn check_entry(
    path: &Path,
    h: &ShardHeader,
    e: &IndexEntry,
    file_bytes: u64,
    chunk_bytes: u64,
) -> Result<()> {
    let count_at = if h.format == ShardFormat::Ferrite {
        16
    } else {
        8
    };
    if e.format != h.format {
        return Err(shard_error(
            path,
            0,
            format!(
                "index says format {}, the header is {}",
                e.format.name(),
                h.format.name()
            ),
        ));
    }
    if e.dtype != h.dtype.name() {
        return Err(shard_error(
            path,
            0,
            format!("index says dtype {}, the header says {}", e.dtype, h.dtype),
        ));
    }
    if e.tokens != h.tokens {
        return Err(shard_error(
            path,
            count_at,
            format!(
                "token count mismatch: index says {}, header says {}",
                e.tokens, h.tokens
            ),
        ));
    }
    if e.bytes != file_bytes {
        return Err(shard_error(
            path,
            file_bytes,
            format!("index says {} bytes, the file is {file_bytes}", e.bytes),
        ));
    }
    if h.format == ShardFormat::Ferrite && h.chunk_bytes != chunk_bytes {
        return Err(shard_error(
            path,
            24,
            format!(
                "header chunk size {} differs from the index's {chunk_bytes}",
                h.chunk_bytes
            ),
        ));
    }
    if let Some(c) = h.payload_crc32 {
        if c != e.crc32 {
            return Err(shard_error(
                path,
                28,
                format!(
                    "index checksum 0x{:08x} differs from the header's 0x{c:08x}",
                    e.crc32
                ),
            ));
        }
    }
    let want_chunks = h.payload_bytes().div_ceil(chunk_bytes);
    if e.chunk_crc32.len() as u64 != want_chunks {
        return Err(shard_error(
            path,
            h.payload_offset,
            format!(
                "index lists {} chunk checksums, {} payload bytes need {want_chunks}",
                e.chunk_crc32.len(),
                h.payload_bytes()
            ),
        ));
    }
    Ok(())
}
