//! The streaming data pipeline: token shards from disk to the GPU, each sample exactly once per
//! epoch, resumable from `(seed, epoch, position)`.
//!
//! - [`mod@format`]: llm.c `.bin` shards (v1 u16, v7 u32), ferrite's `.ftok` shards and the
//!   `index.json` that records dtype, token count and checksums per shard.
//! - [`pack`]: text → shards with the GPT-2 BPE (feature `pack`), token arrays → shards.
//! - [`order`]: the sample order (two-level shuffle by (seed, epoch)), rank sharding, remainder.
//! - `io`: io_uring + O_DIRECT reads, with a pread thread-pool fallback ([`IoConfig`] chooses).
//! - [`loader`]: the loader itself (host tensors, or device tensors through a pinned ring).
//! - `bench`: the read ceiling, loader throughput and a simulated training loop
//!   (`ferrite data bench`).
//!
//! See docs/data.md for the formats, semantics and measured numbers.

// `ferrite data bench` and the read engines it times: pub for the CLI's data bench; the loader's
// read settings are re-exported below.
#[doc(hidden)]
pub mod bench;
pub mod format;
mod gpu;
#[doc(hidden)]
pub mod io;
pub mod loader;
pub mod order;
pub mod pack;
#[cfg(test)]
mod tests;

pub use format::{Index, IndexEntry, ShardFormat, ShardHeader};
pub use io::{EngineKind, IoConfig};
pub use loader::{Batch, Dataset, Loader, LoaderConfig, LoaderState, LoaderStats};
pub use order::Remainder;
#[cfg(feature = "pack")]
pub use pack::pack_files;
pub use pack::{PackConfig, PackSummary};
