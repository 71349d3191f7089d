//! Tests of the data pipeline on small corpora generated here.

use super::format::{self, read_header, verify_shard, Index, ShardFormat, INDEX_FILE};
use super::io::{EngineKind, IoConfig};
use super::loader::{Dataset, Loader, LoaderConfig, LoaderState};
use super::order::{mix64, Remainder};
use super::pack::write_shards;
#[cfg(feature = "pack")]
use super::pack::{self, PackConfig};
use crate::core::dtype::DType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A fresh temporary folder, removed on drop.
struct TmpDir(PathBuf);
impl TmpDir {
    fn new(tag: &str) -> TmpDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // /var/tmp is disk-backed where /tmp may be tmpfs (which refuses O_DIRECT).
        let base = if Path::new("/var/tmp").is_dir() {
            PathBuf::from("/var/tmp")
        } else {
            std::env::temp_dir()
        };
        let p = base.join(format!(
            "ferrite-data-test-{}-{tag}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TmpDir(p)
    }
}
impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tokens(n: usize, salt: u64, vocab: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (mix64(i as u64 ^ (salt << 40)) % vocab as u64) as u32)
        .collect()
}

/// Three shards of uneven lengths.
fn corpus(dir: &Path, format: ShardFormat, dtype: DType) -> Vec<Vec<u32>> {
    let vocab = if dtype == DType::U16 { 50257 } else { 100_000 };
    let shards: Vec<Vec<u32>> = [1000usize, 777, 1500]
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(n, i as u64 + 1, vocab))
        .collect();
    write_shards(dir, format, dtype, 4096, &shards, vocab).unwrap();
    shards
}

fn cfg(batch: usize, seq: usize, rank: usize, world: usize) -> LoaderConfig {
    LoaderConfig {
        batch,
        seq,
        rank,
        world,
        seed: 1234,
        shuffle: true,
        epochs: Some(2),
        prefetch: 2,
        // Small blocks and windows so a tiny corpus spans many of both.
        block_bytes: 128,
        window_blocks: 3,
        io: IoConfig {
            queue_depth: 4,
            threads: 2,
            request_bytes: 8192,
            ..IoConfig::default()
        },
        ..LoaderConfig::default()
    }
}

/// The expected T+1 tokens of global sample `s`.
fn expected(shards: &[Vec<u32>], seq: usize, s: u64) -> Vec<u32> {
    let mut s = s as usize;
    for sh in shards {
        let n = if sh.len() > seq {
            (sh.len() - 1) / seq
        } else {
            0
        };
        if s < n {
            return sh[s * seq..s * seq + seq + 1].to_vec();
        }
        s -= n;
    }
    panic!("sample out of range")
}

fn rows(b: &super::Batch) -> Vec<Vec<u32>> {
    let t = b.tokens.to_f64_vec().unwrap();
    let w = b.tokens.shape()[1];
    t.chunks(w)
        .map(|r| r.iter().map(|&x| x as u32).collect())
        .collect()
}

/// (epoch, position, samples, rows) of every batch.
type Trace = Vec<(u64, u64, Vec<u64>, Vec<Vec<u32>>)>;

fn run(
    ds: &Dataset,
    c: LoaderConfig,
    resume: Option<LoaderState>,
    limit: Option<usize>,
) -> (Trace, LoaderState, Loader) {
    let mut l = Loader::new(ds, c, resume).unwrap();
    let mut out = Vec::new();
    while limit.is_none_or(|n| out.len() < n) {
        match l.next_batch().unwrap() {
            Some(b) => out.push((b.epoch, b.position, b.samples.clone(), rows(&b))),
            None => break,
        }
    }
    let s = l.state();
    (out, s, l)
}

#[test]
fn exactly_once_over_ranks_and_epochs() {
    for (format, dtype) in [
        (ShardFormat::Ferrite, DType::U16),
        (ShardFormat::LlmcV7, DType::U32),
    ] {
        let dir = TmpDir::new("once");
        let shards = corpus(&dir.0, format, dtype);
        let ds = Dataset::open(&dir.0).unwrap();
        let (b, t) = (3usize, 16usize);
        let total: u64 = ds.samples_per_shard(t as u64).iter().sum();
        for remainder in [Remainder::Drop, Remainder::Pad] {
            for world in 1..=8usize {
                let mut seen: HashMap<u64, Vec<u64>> = HashMap::new(); // epoch → samples
                let mut steps = None;
                for rank in 0..world {
                    let c = LoaderConfig {
                        remainder,
                        ..cfg(b, t, rank, world)
                    };
                    let (trace, _, _) = run(&ds, c, None, None);
                    // Every rank takes the same number of steps (lockstep).
                    assert_eq!(
                        *steps.get_or_insert(trace.len()),
                        trace.len(),
                        "world {world} rank {rank}"
                    );
                    for (epoch, _, samples, rs) in trace {
                        assert_eq!(rs.len(), b);
                        for (i, &s) in samples.iter().enumerate() {
                            assert_eq!(rs[i], expected(&shards, t, s), "sample {s} content");
                        }
                        for r in &rs[samples.len()..] {
                            assert!(
                                r.iter().all(|&x| x == 50256),
                                "padding rows hold the pad token"
                            );
                        }
                        seen.entry(epoch).or_default().extend(samples);
                    }
                }
                assert_eq!(seen.len(), 2, "two epochs");
                let mut orders = Vec::new();
                for (epoch, mut v) in seen {
                    let n = v.len() as u64;
                    let g = (world * b) as u64;
                    let want = if remainder == Remainder::Drop {
                        total - total % g
                    } else {
                        total
                    };
                    assert_eq!(
                        n, want,
                        "{format:?} {remainder:?} world {world} epoch {epoch}"
                    );
                    orders.push(v.clone());
                    v.sort_unstable();
                    v.dedup();
                    assert_eq!(
                        v.len() as u64,
                        n,
                        "a sample delivered twice (world {world}, epoch {epoch})"
                    );
                    assert!(v.iter().all(|&s| s < total));
                }
            }
        }
    }
}

#[test]
fn shuffle_depends_on_seed_and_epoch() {
    let dir = TmpDir::new("shuffle");
    corpus(&dir.0, ShardFormat::Ferrite, DType::U16);
    let ds = Dataset::open(&dir.0).unwrap();
    let (a, _, _) = run(&ds, cfg(4, 16, 0, 1), None, None);
    let (a2, _, _) = run(&ds, cfg(4, 16, 0, 1), None, None);
    let (b, _, _) = run(
        &ds,
        LoaderConfig {
            seed: 99,
            ..cfg(4, 16, 0, 1)
        },
        None,
        None,
    );
    let ids = |t: &Trace, e: u64| {
        t.iter()
            .filter(|x| x.0 == e)
            .flat_map(|x| x.2.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&a, 0), ids(&a2, 0), "same seed, same order");
    assert_ne!(ids(&a, 0), ids(&b, 0), "another seed, another order");
    assert_ne!(ids(&a, 0), ids(&a, 1), "another epoch, another order");
    let (c, _, _) = run(
        &ds,
        LoaderConfig {
            shuffle: false,
            ..cfg(4, 16, 0, 1)
        },
        None,
        None,
    );
    let plain = ids(&c, 0);
    assert!(
        plain.windows(2).all(|w| w[1] == w[0] + 1),
        "no shuffle: in order"
    );
}

#[test]
fn resume_mid_epoch_is_identical_with_other_workers() {
    let dir = TmpDir::new("resume");
    corpus(&dir.0, ShardFormat::Ferrite, DType::U16);
    let ds = Dataset::open(&dir.0).unwrap();
    let base = cfg(4, 16, 0, 1);
    let (full, _, _) = run(&ds, base.clone(), None, None);
    for stop in [1usize, 7, 12, 20] {
        let (head, state, l) = run(&ds, base.clone(), None, Some(stop));
        drop(l); // the loader had read ahead; that must not matter
        assert_eq!(&full[..stop], &head[..]);
        // Resume with another engine, worker count, queue depth, prefetch and request size.
        let other = LoaderConfig {
            prefetch: 1,
            read_ahead: 1,
            io: IoConfig {
                engine: EngineKind::Pread,
                threads: 5,
                queue_depth: 1,
                direct: false,
                request_bytes: 4096,
            },
            ..base.clone()
        };
        let json = serde_json::to_string(&state).unwrap();
        let state: LoaderState = serde_json::from_str(&json).unwrap();
        let (tail, _, _) = run(&ds, other, Some(state), None);
        assert_eq!(&full[stop..], &tail[..], "resume after {stop} batches");
    }
    // A state from another order is refused.
    let (_, state, _) = run(&ds, base.clone(), None, Some(3));
    let e = Loader::new(
        &ds,
        LoaderConfig {
            seq: 8,
            ..base.clone()
        },
        Some(state),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("another order"), "{e}");
}

#[test]
fn resume_after_world_size_change_is_exactly_once() {
    let dir = TmpDir::new("world");
    corpus(&dir.0, ShardFormat::Ferrite, DType::U16);
    let ds = Dataset::open(&dir.0).unwrap();
    let total: u64 = ds.samples_per_shard(16).iter().sum();
    let one_epoch = |r, w| LoaderConfig {
        epochs: Some(1),
        remainder: Remainder::Pad,
        ..cfg(2, 16, r, w)
    };
    // 2 ranks for 5 steps, then 3 ranks to the end of the epoch.
    let mut seen = Vec::new();
    let mut state = None;
    for r in 0..2 {
        let (t, s, _) = run(&ds, one_epoch(r, 2), None, Some(5));
        seen.extend(t.into_iter().flat_map(|x| x.2));
        assert!(
            state.is_none_or(|p| p == s),
            "every rank holds the same state"
        );
        state = Some(s);
    }
    for r in 0..3 {
        let (t, _, _) = run(&ds, one_epoch(r, 3), state, None);
        seen.extend(t.into_iter().flat_map(|x| x.2));
    }
    let n = seen.len();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!((n as u64, seen.len() as u64), (total, total));
}

#[test]
fn fallback_path_yields_the_same_batches() {
    let dir = TmpDir::new("fallback");
    corpus(&dir.0, ShardFormat::Ferrite, DType::U16);
    let ds = Dataset::open(&dir.0).unwrap();
    let (fast, _, l) = run(&ds, cfg(4, 16, 0, 1), None, None);
    eprintln!("fast path: {} {:?}", l.stats().io, l.stats().fallback);
    for (direct, threads) in [(false, 1), (true, 3)] {
        let c = LoaderConfig {
            io: IoConfig {
                engine: EngineKind::Pread,
                direct,
                threads,
                ..cfg(4, 16, 0, 1).io
            },
            ..cfg(4, 16, 0, 1)
        };
        let (slow, _, l) = run(&ds, c, None, None);
        eprintln!("fallback: {}", l.stats().io);
        assert_eq!(fast, slow);
    }
    // Also with i32 output and no verification: same tokens.
    let (wide, _, _) = run(
        &ds,
        LoaderConfig {
            out_dtype: Some(DType::I32),
            verify: false,
            ..cfg(4, 16, 0, 1)
        },
        None,
        None,
    );
    assert_eq!(fast, wide);
}

/// The pipeline's flow control: a consumer slower than the disk (so the I/O thread fills every
/// buffer it may and blocks), shallow queues, both engines, and a drop while threads are blocked.
/// The batches must not change, window buffers must be reused, and nothing may hang.
#[test]
fn slow_consumer_and_shallow_queues_keep_batches_and_reuse_buffers() {
    let dir = TmpDir::new("flow");
    let vocab = 50257;
    let shards: Vec<Vec<u32>> = (0..2).map(|i| tokens(100_000, 90 + i, vocab)).collect();
    write_shards(
        &dir.0,
        ShardFormat::Ferrite,
        DType::U16,
        4096,
        &shards,
        vocab,
    )
    .unwrap();
    let ds = Dataset::open(&dir.0).unwrap();
    let t = 16usize;
    // Windows of 2 blocks × 128 samples (8 KiB of tokens): about 49 windows per epoch.
    let base = LoaderConfig {
        block_bytes: 4096,
        window_blocks: 2,
        prefetch: 1,
        read_ahead: 1,
        io: IoConfig {
            queue_depth: 2,
            threads: 1,
            request_bytes: 4096,
            ..IoConfig::default()
        },
        ..cfg(8, t, 0, 1)
    };
    let (reference, _, _) = run(
        &ds,
        LoaderConfig {
            prefetch: 8,
            read_ahead: 8,
            ..base.clone()
        },
        None,
        None,
    );
    assert!(reference.len() > 2000, "{} batches", reference.len());
    for engine in [EngineKind::Auto, EngineKind::Pread] {
        let c = LoaderConfig {
            io: IoConfig {
                engine,
                ..base.io.clone()
            },
            ..base.clone()
        };
        let mut l = Loader::new(&ds, c.clone(), None).unwrap();
        let mut trace = Vec::new();
        while let Some(b) = l.next_batch().unwrap() {
            if trace.len() % 400 < 20 {
                // Slow stretches: every buffer ahead fills up and the I/O thread waits.
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            trace.push((b.epoch, b.position, b.samples.clone(), rows(&b)));
        }
        assert!(trace == reference, "{engine:?}: batches differ");
        let st = l.stats();
        eprintln!(
            "{engine:?}: {} batches, {} window buffers, {}",
            trace.len(),
            st.buffers,
            st.io
        );
        assert!(
            st.buffers <= 16,
            "{engine:?}: {} window buffers allocated for ~100 windows",
            st.buffers
        );
        // Dropped while the threads are blocked on full queues.
        let mut l = Loader::new(&ds, c, None).unwrap();
        l.next_batch().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let t0 = std::time::Instant::now();
        drop(l);
        assert!(
            t0.elapsed().as_secs_f64() < 2.0,
            "drop took {:?}",
            t0.elapsed()
        );
    }
}

/// The bench's raw reads: a whole pass reads every byte once; a partial pass from any start
/// reads what was asked (to 4096 bytes), wrapping around the end of the data.
#[test]
fn raw_read_covers_the_data_from_any_start() {
    use super::bench::raw_read;
    let dir = TmpDir::new("raw");
    corpus(&dir.0, ShardFormat::Ferrite, DType::U16);
    let ds = Dataset::open(&dir.0).unwrap();
    let total = ds.total_bytes();
    for engine in [EngineKind::Auto, EngineKind::Pread] {
        let all = raw_read(&ds, 8192, 3, engine, 0, 0).unwrap();
        assert_eq!(all.bytes, total, "{engine:?}");
        for (start, want) in [
            (0, 5000),
            (4096, total),
            (total - 10, 9000),
            (7777, 3 * total),
        ] {
            let c = raw_read(&ds, 8192, 2, engine, start, want).unwrap();
            let want = want.min(total);
            assert!(
                c.bytes >= want && c.bytes < want + 4096 * ds.shards.len() as u64,
                "{engine:?} from {start}: {} bytes for {want}",
                c.bytes
            );
        }
    }
}

/// One u16 shard of `toks` (GPT-2 vocabulary) written into `dir` as `format`: its index and path.
fn one_shard(dir: &Path, format: ShardFormat, toks: &[u32]) -> (Index, PathBuf) {
    let idx = write_shards(dir, format, DType::U16, 4096, &[toks.to_vec()], 50257).unwrap();
    let path = dir.join(&idx.shards[0].file);
    (idx, path)
}

fn err_of<T>(r: crate::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_header_byte_and_payload_byte_corruption_is_detected() {
    for format in [ShardFormat::Ferrite, ShardFormat::LlmcV1] {
        let dir = TmpDir::new("corrupt");
        let toks = tokens(600, 5, 50257);
        let (idx, path) = one_shard(&dir.0, format, &toks);
        let good = std::fs::read(&path).unwrap();
        let hb = format.header_bytes() as usize;
        // Every header byte (checked in memory: the same code the file path runs): the header
        // check fails, naming the shard and the offset.
        for i in 0..hb {
            for flip in [0x01u8, 0x80] {
                let mut bad = good.clone();
                bad[i] ^= flip;
                let e = err_of(format::verify_bytes(
                    &path,
                    &bad,
                    Some(&idx.shards[0]),
                    4096,
                ));
                assert!(
                    e.contains("shard_000000") && e.contains("at byte"),
                    "byte {i}: {e}"
                );
            }
        }
        // Every payload byte: the chunk checksum fails, naming shard and offset.
        for i in hb..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            let e = err_of(format::verify_bytes(
                &path,
                &bad,
                Some(&idx.shards[0]),
                4096,
            ));
            assert!(
                e.contains("shard_000000") && e.contains(&format!("at byte {hb}")),
                "byte {i}: {e}"
            );
        }
        // A header byte flipped on disk is caught when the dataset is opened.
        for i in [0usize, 5, 9, 13, 17, 30, 100, hb - 1] {
            let mut bad = good.clone();
            bad[i] ^= 0x02;
            std::fs::write(&path, &bad).unwrap();
            let e = err_of(Dataset::open(&dir.0));
            assert!(
                e.contains("shard_000000") && e.contains("at byte"),
                "byte {i}: {e}"
            );
        }
        // And the loader itself stops with that error (a sample of payload bytes).
        for i in (hb..good.len()).step_by(97) {
            let mut bad = good.clone();
            bad[i] ^= 0x04;
            std::fs::write(&path, &bad).unwrap();
            let ds = Dataset::open(&dir.0).unwrap();
            let mut l = Loader::new(
                &ds,
                LoaderConfig {
                    shuffle: false,
                    ..cfg(2, 16, 0, 1)
                },
                None,
            )
            .unwrap();
            let e = loop {
                match l.next_batch() {
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("corrupt byte {i} not detected"),
                    Err(e) => break e.to_string(),
                }
            };
            assert!(
                e.contains("checksum mismatch")
                    && e.contains("shard_000000")
                    && e.contains("at byte"),
                "{e}"
            );
        }
        std::fs::write(&path, &good).unwrap();
        verify_shard(&path, Some(&idx.shards[0]), 4096).unwrap();
    }
}

#[test]
fn bad_inputs_give_errors_naming_shard_and_offset() {
    let dir = TmpDir::new("bad");
    let toks = tokens(500, 9, 50257);
    let (idx, path) = one_shard(&dir.0, ShardFormat::Ferrite, &toks);
    let good = std::fs::read(&path).unwrap();
    let expect = |what: &str, want: &[&str]| {
        let e = err_of(Dataset::open(&dir.0));
        for w in want {
            assert!(e.contains(w), "{what}: {e:?} lacks {w:?}");
        }
        assert!(e.contains("shard_000000"), "{what}: {e}");
    };
    std::fs::write(&path, &good[..good.len() - 3]).unwrap();
    expect("truncated", &["truncated", "at byte"]);
    std::fs::write(&path, &good[..100]).unwrap();
    expect("truncated header", &["truncated header", "at byte 100"]);
    let mut more = good.clone();
    more.extend_from_slice(&[0, 0]);
    std::fs::write(&path, &more).unwrap();
    expect("count mismatch", &["token count mismatch", "at byte"]);
    std::fs::write(&path, b"").unwrap();
    expect("empty", &["empty", "at byte 0"]);
    std::fs::remove_file(&path).unwrap();
    expect("missing", &["cannot open", "at byte 0"]);
    std::fs::create_dir(&path).unwrap();
    expect("unreadable", &["at byte 0"]);
    std::fs::remove_dir(&path).unwrap();

    // llm.c: wrong magic, wrong version, empty (count 0), count mismatch.
    let one = dir.0.join("one.bin");
    let mut h = format::encode_header(ShardFormat::LlmcV1, 10, 0, 0, 0);
    h.extend(std::iter::repeat_n(7u8, 20));
    type Corrupt = Box<dyn Fn(&mut Vec<u8>)>;
    let variants: Vec<(&str, Corrupt, &str)> = vec![
        ("magic", Box::new(|b: &mut Vec<u8>| b[0] ^= 1), "bad magic"),
        (
            "version",
            Box::new(|b: &mut Vec<u8>| b[4] = 7),
            "bad version",
        ),
        (
            "zero count",
            Box::new(|b: &mut Vec<u8>| b[8..12].copy_from_slice(&0i32.to_le_bytes())),
            "empty shard",
        ),
        ("count", Box::new(|b: &mut Vec<u8>| b[8] = 11), "truncated"),
        (
            "count low",
            Box::new(|b: &mut Vec<u8>| b[8] = 9),
            "token count mismatch",
        ),
        (
            "v7 with v1 magic",
            Box::new(|b: &mut Vec<u8>| {
                b[0..4].copy_from_slice(&format::LLMC_MAGIC_V7.to_le_bytes())
            }),
            "bad version",
        ),
    ];
    for (what, f, want) in variants {
        let mut b = h.clone();
        f(&mut b);
        std::fs::write(&one, &b).unwrap();
        let e = err_of(Dataset::open(&one));
        assert!(
            e.contains(want) && e.contains("one.bin") && e.contains("at byte"),
            "{what}: {e}"
        );
    }
    std::fs::write(&one, &h).unwrap();
    assert_eq!(read_header(&one).unwrap().tokens, 10);

    // Index problems.
    let ipath = dir.0.join(INDEX_FILE);
    std::fs::write(&ipath, "{ not json").unwrap();
    let e = err_of(Dataset::open(&dir.0));
    assert!(e.contains("index.json") && e.contains("line 1"), "{e}");
    // A header that disagrees with its index entry.
    std::fs::write(&path, &good).unwrap();
    let mut i2 = idx.clone();
    i2.shards[0].tokens += 1;
    i2.total_tokens += 1;
    i2.write(&ipath).unwrap();
    let e = err_of(Dataset::open(&dir.0));
    assert!(
        e.contains("token count mismatch") && e.contains("at byte 16"),
        "{e}"
    );
    let _ = Index::read(&ipath).unwrap();
}

#[test]
fn loader_refuses_bad_configs() {
    let dir = TmpDir::new("cfg");
    corpus(&dir.0, ShardFormat::Ferrite, DType::U16);
    let ds = Dataset::open(&dir.0).unwrap();
    assert!(Loader::new(&ds, cfg(0, 16, 0, 1), None).is_err());
    assert!(Loader::new(&ds, cfg(2, 16, 2, 2), None).is_err());
    let e = err_of(Loader::new(&ds, cfg(2, 5000, 0, 1), None));
    assert!(e.contains("no sample"), "{e}");
    let e = err_of(Loader::new(&ds, cfg(300, 16, 0, 1), None));
    assert!(e.contains("fewer than one global batch"), "{e}");
    assert!(Loader::new(
        &ds,
        LoaderConfig {
            remainder: Remainder::Pad,
            ..cfg(300, 16, 0, 1)
        },
        None
    )
    .is_ok());
    let u32ds = TmpDir::new("cfg32");
    corpus(&u32ds.0, ShardFormat::Ferrite, DType::U32);
    let ds32 = Dataset::open(&u32ds.0).unwrap();
    assert!(Loader::new(
        &ds32,
        LoaderConfig {
            out_dtype: Some(DType::U16),
            ..cfg(2, 16, 0, 1)
        },
        None
    )
    .is_err());
}

#[test]
#[cfg(feature = "pack")]
fn pack_round_trips_text_through_gpt2() {
    let dir = TmpDir::new("pack");
    let inputs = dir.0.join("in");
    std::fs::create_dir_all(&inputs).unwrap();
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "thou", "art", "—", "naïve",
    ];
    let mut texts = Vec::new();
    for f in 0..5u64 {
        let t: String = (0..400u64)
            .map(|i| {
                format!(
                    "{} ",
                    words[(mix64(f * 1000 + i) % words.len() as u64) as usize]
                )
            })
            .collect();
        let p = inputs.join(format!("doc{f}.txt"));
        std::fs::write(&p, &t).unwrap();
        texts.push((p, t));
    }
    let jsonl = inputs.join("more.jsonl");
    std::fs::write(
        &jsonl,
        "{\"text\": \"Hello world.\"}\n\n{\"text\": \"To be, or not to be\"}\n",
    )
    .unwrap();
    let mut files: Vec<PathBuf> = texts.iter().map(|x| x.0.clone()).collect();
    files.push(jsonl);
    for format in [ShardFormat::Ferrite, ShardFormat::LlmcV1] {
        let out = dir.0.join(format!("out-{}", format.name()));
        let c = PackConfig {
            out_dir: out.clone(),
            format,
            shard_tokens: 700,
            ..PackConfig::default()
        };
        let mut calls = 0;
        let sum = pack::pack_files(&files, &c, &mut |_, _, _| calls += 1).unwrap();
        assert_eq!(calls, files.len());
        assert_eq!(sum.documents, 7);
        assert!(sum.shards >= 3, "{sum:?}");
        let ds = Dataset::open(&out).unwrap();
        assert_eq!(ds.total_tokens(), sum.tokens);
        // Concatenate every shard's payload and decode it.
        let mut all = Vec::new();
        for s in &ds.shards {
            let h = read_header(&s.path).unwrap();
            let b = std::fs::read(&s.path).unwrap();
            all.extend(
                b[h.payload_offset as usize..]
                    .chunks(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            );
        }
        let bpe = pack::gpt2().unwrap();
        let text = bpe.decode(&all).unwrap();
        let mut want = String::new();
        for (_, t) in &texts {
            want.push_str("<|endoftext|>");
            want.push_str(t);
        }
        want.push_str("<|endoftext|>Hello world.<|endoftext|>To be, or not to be");
        assert_eq!(text, want);
        assert_eq!(all.iter().filter(|&&t| t == pack::GPT2_EOT).count(), 7);
        for (s, e) in ds.shards.iter().zip(&ds.index.as_ref().unwrap().shards) {
            verify_shard(&s.path, Some(e), ds.chunk_bytes).unwrap();
        }
    }
    // Bad inputs.
    std::fs::write(inputs.join("bad.txt"), [b'a', 0xff, b'b']).unwrap();
    let e = err_of(pack::pack_files(
        &[inputs.join("bad.txt")],
        &PackConfig {
            out_dir: dir.0.join("x"),
            ..PackConfig::default()
        },
        &mut |_, _, _| {},
    ));
    assert!(e.contains("bad.txt") && e.contains("at byte 1"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_batches_match_host_batches() {
    let dir = TmpDir::new("gpu");
    corpus(&dir.0, ShardFormat::Ferrite, DType::U16);
    let ds = Dataset::open(&dir.0).unwrap();
    let (host, _, _) = run(&ds, cfg(4, 16, 0, 1), None, None);
    for dt in [None, Some(DType::I32)] {
        let c = LoaderConfig {
            device: crate::Device::Cuda(0),
            out_dtype: dt,
            ..cfg(4, 16, 0, 1)
        };
        let (gpu, _, _) = run(&ds, c, None, None);
        assert_eq!(host, gpu);
    }
}

/// Sizes that would never advance or abort the process allocating are refused up front: the
/// bench's request size, compute factor and read-ahead, the loader's batch and queues.
#[test]
fn bench_and_loader_refuse_sizes_that_cannot_run() {
    let dir = std::env::temp_dir().join(format!("ferrite-data-bounds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    crate::data::pack::write_shards(
        &dir,
        ShardFormat::Ferrite,
        DType::U16,
        1 << 16,
        &[(0..5000u32).collect()],
        50257,
    )
    .unwrap();
    let ds = Dataset::open(&dir).unwrap();
    let base = crate::data::bench::BenchConfig {
        batch: 2,
        seq: 16,
        io: IoConfig::default(),
        fixed_request: true,
        fixed_depth: true,
        ceiling_requests: vec![],
        ceiling_depths: vec![],
        sweep_bytes: 0,
        sweep_repeats: 1,
        rounds: 1,
        max_bytes: 0,
        compute_factor: 1.0,
        gpu: None,
        sim_steps: 1,
        sim_seconds: 0.0,
        sim_sleep: true,
        read_ahead: 2,
        prefetch: 2,
        verify: true,
        warmup: false,
        shuffle: true,
    };
    assert!(base.validate().is_ok());
    let cases: Vec<(crate::data::bench::BenchConfig, &str)> = vec![
        (
            crate::data::bench::BenchConfig {
                io: IoConfig {
                    request_bytes: 0,
                    ..IoConfig::default()
                },
                ..base.clone()
            },
            "--request-kib",
        ),
        (
            crate::data::bench::BenchConfig {
                compute_factor: -1.0,
                ..base.clone()
            },
            "--compute-factor",
        ),
        (
            crate::data::bench::BenchConfig {
                compute_factor: f64::NAN,
                ..base.clone()
            },
            "--compute-factor",
        ),
        (
            crate::data::bench::BenchConfig {
                compute_factor: 1e300,
                ..base.clone()
            },
            "--compute-factor",
        ),
        (
            crate::data::bench::BenchConfig {
                read_ahead: 100_000_000,
                ..base.clone()
            },
            "--read-ahead",
        ),
    ];
    for (cfg, arg) in cases {
        let e = crate::data::bench::run(&ds, &cfg, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains(arg), "{arg}: {e}");
    }
    let huge = LoaderConfig {
        batch: 99_999_999_999,
        seq: 2,
        ..LoaderConfig::default()
    };
    let e = Loader::new(&ds, huge, None).err().unwrap().to_string();
    assert!(e.contains("B·(T+1)"), "{e}");
    let deep = LoaderConfig {
        batch: 2,
        seq: 16,
        read_ahead: 100_000_000,
        ..LoaderConfig::default()
    };
    let e = Loader::new(&ds, deep, None).err().unwrap().to_string();
    assert!(e.contains("read_ahead"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_standalone_shard_with_a_flipped_payload_byte_is_refused_at_open() {
    let dir = TmpDir::new("standalone");
    let toks = tokens(3000, 9, 50257);
    let (_, path) = one_shard(&dir.0, ShardFormat::Ferrite, &toks);
    // Without an index the shard opens and is verified against its header's checksum.
    Dataset::open(&path).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 7;
    bytes[at] ^= 0x04;
    std::fs::write(&path, &bytes).unwrap();
    let e = err_of(Dataset::open(&path));
    assert!(
        e.contains("payload checksum mismatch") && e.contains("shard_000000"),
        "{e}"
    );
}

#[test]
#[cfg(feature = "pack")]
fn a_pack_that_fails_midway_leaves_the_previous_corpus_intact() {
    let dir = TmpDir::new("pack-fail");
    let good: Vec<PathBuf> = (0..3)
        .map(|i| {
            let p = dir.0.join(format!("good{i}.txt"));
            std::fs::write(
                &p,
                "to be or not to be, that is the question ".repeat(40 + i),
            )
            .unwrap();
            p
        })
        .collect();
    let bad = dir.0.join("bad.txt");
    std::fs::write(&bad, [0x66u8, 0x6f, 0xff, 0xfe, 0x6f]).unwrap(); // not UTF-8
    let out = dir.0.join("corpus");
    let cfg = PackConfig {
        out_dir: out.clone(),
        shard_tokens: 300,
        ..PackConfig::default()
    };
    let noop = &mut |_: u64, _: u64, _: u64| {};
    pack::pack_files(&good, &cfg, noop).unwrap();
    let snapshot = |d: &Path| -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap_or_default(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let before = snapshot(&out);
    assert!(
        before.len() > 2,
        "{:?}",
        before.iter().map(|x| &x.0).collect::<Vec<_>>()
    );
    // A second pack into the same folder with a bad third input: an error, and not a byte changed.
    let mut inputs = vec![good[1].clone(), good[0].clone(), bad];
    inputs.extend(good.iter().cloned());
    let e = err_of(pack::pack_files(&inputs, &cfg, noop));
    assert!(e.contains("bad.txt"), "{e}");
    assert_eq!(snapshot(&out), before);
    // A successful repack replaces the corpus: the new index lists only shards that exist.
    pack::pack_files(&good[..1], &cfg, noop).unwrap();
    let ds = Dataset::open(&out).unwrap();
    assert!(ds.total_tokens() > 0);
    let files: Vec<String> = snapshot(&out).into_iter().map(|x| x.0).collect();
    let idx = Index::read(&out.join(INDEX_FILE)).unwrap();
    assert_eq!(files.len(), idx.shards.len() + 1, "{files:?}");
}
