//! The verifier: every chunk read is checked against the index's CRC-32 before the assembler
//! sees it.

use super::plan::Geometry;
use super::read::Window;
use crate::core::error::Result;
use crate::data::format::shard_error;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

/// Verifies every whole checksum chunk an extent covers (extents are widened to whole chunks).
fn verify(geo: &Geometry, w: &Window) -> Result<()> {
    let c = geo.chunk_bytes;
    let mut jobs = Vec::new();
    for e in &w.extents {
        let sh = &geo.shards[e.shard];
        let po = sh.header.payload_offset;
        let first = (e.lo.max(po) - po).div_ceil(c);
        let mut k = first;
        loop {
            let a = po + k * c;
            let b = (a + c).min(sh.file_bytes);
            if a >= e.hi || b > e.hi {
                break;
            }
            jobs.push((e.shard, k, a, b, e.buf_off + (a - e.lo) as usize));
            k += 1;
        }
    }
    let buf = w.buf.as_slice();
    let check = |&(s, k, a, b, at): &(usize, u64, u64, u64, usize)| -> Result<()> {
        let sh = &geo.shards[s];
        let want = sh
            .chunk_crc32
            .as_ref()
            .and_then(|v| v.get(k as usize).copied());
        let got = crc32fast::hash(&buf[at..at + (b - a) as usize]);
        match want {
            Some(w) if w == got => Ok(()),
            Some(w) => Err(shard_error(
                &sh.path,
                a,
                format!("checksum mismatch in payload bytes {a}..{b} (chunk {k}: index 0x{w:08x}, data read 0x{got:08x})"),
            )),
            None => Err(shard_error(&sh.path, a, format!("no checksum for chunk {k} in the index"))),
        }
    };
    // On the verifier's own thread, in sequence: one core hashes 5–10 GB/s (CRC-32 with
    // carry-less multiplies), several times the disks this loader meets; the global thread pool
    // is left to the training's CPU work.
    jobs.iter().try_for_each(check)
}

/// The verifier thread: checks each window's chunks against the index between the I/O thread
/// and the assembler, so neither waits on it (it used to run on the I/O thread, which stopped
/// queueing reads while it hashed).
pub(super) fn verify_thread(
    geo: Arc<Geometry>,
    windows: Receiver<Result<Window>>,
    out: SyncSender<Result<Window>>,
) {
    for w in windows.iter() {
        let r = w.and_then(|w| verify(&geo, &w).map(|()| w));
        let failed = r.is_err();
        if out.send(r).is_err() || failed {
            return;
        }
    }
}
