//! Autotuning by measurement: the first time a (device, op, variant, dtype, shape class) is seen,
//! each candidate configuration is timed and the winner is remembered on disk next to the kernel
//! cache (`<cache>/tune.json`), so later runs and processes pick it without measuring.

use super::cuda::jit::cache_dir;
use super::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

fn path() -> PathBuf {
    cache_dir().join("tune.json")
}

fn table() -> &'static Mutex<BTreeMap<String, String>> {
    static T: OnceLock<Mutex<BTreeMap<String, String>>> = OnceLock::new();
    T.get_or_init(|| {
        let map = std::fs::read_to_string(path())
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default();
        Mutex::new(map)
    })
}

fn save(map: &BTreeMap<String, String>) {
    // A failed write only costs a re-tune in the next process.
    let p = path();
    if let Some(dir) = p.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Ok(s) = serde_json::to_string_pretty(map) {
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, s).is_ok() {
            let _ = std::fs::rename(tmp, p);
        }
    }
}

/// Shapes in one class share a tuning result: each dim rounded up to a power of two.
pub fn shape_class(dims: &[usize]) -> String {
    dims.iter()
        .map(|d| d.max(&1).next_power_of_two().to_string())
        .collect::<Vec<_>>()
        .join("x")
}

/// How a configuration was chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// Remembered from an earlier measurement.
    Cached,
    /// Measured now; the times of every candidate (ms, +inf for one that failed).
    Measured(Vec<f64>),
    /// Not measured and not remembered: measuring was not possible now (see [`not_now`]), so
    /// the first candidate — the default — was taken.
    Default,
}

const NOT_NOW: &str = "tuning deferred: ";

/// The error a timing closure returns when it must not measure now (e.g. its stream is capturing
/// a CUDA graph, where nothing may synchronise): `pick` then takes the first candidate without
/// remembering it, and measures at a later call.
pub fn not_now(why: &str) -> Error {
    Error::Other(format!("{NOT_NOW}{why}"))
}

fn is_not_now(e: &Error) -> bool {
    matches!(e, Error::Other(m) if m.starts_with(NOT_NOW))
}

/// The remembered choice among `candidates` for `key`, if any (no measuring).
pub fn remembered<C: Clone + std::fmt::Display>(key: &str, candidates: &[C]) -> Option<C> {
    let map = table().lock().unwrap();
    let name = map.get(key)?;
    candidates.iter().find(|c| &c.to_string() == name).cloned()
}

/// The best of `candidates` for `key`: remembered, or measured now with `time` (milliseconds;
/// an error counts as a candidate that cannot run). Candidates are told apart by `Display`.
pub fn pick<C: Clone + std::fmt::Display>(
    key: &str,
    candidates: &[C],
    mut time: impl FnMut(&C) -> Result<f64>,
) -> Result<(C, Choice)> {
    if candidates.is_empty() {
        return Err(Error::Other(format!("tune {key}: no candidates")));
    }
    if let Some(c) = remembered(key, candidates) {
        return Ok((c, Choice::Cached));
    }
    // The first refusal is kept for the message should none run: "could not run" alone hid a
    // launch error (a shared-memory opt-in missing) behind the tuner once.
    let mut first_err: Option<String> = None;
    let mut times: Vec<f64> = Vec::with_capacity(candidates.len());
    for c in candidates {
        match time(c) {
            Ok(t) => times.push(t),
            Err(e) if is_not_now(&e) => return Ok((candidates[0].clone(), Choice::Default)),
            Err(e) => {
                first_err.get_or_insert_with(|| format!("{c}: {e}"));
                times.push(f64::INFINITY);
            }
        }
    }
    let (best, t) = times
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, t)| (i, *t))
        .unwrap();
    if !t.is_finite() {
        return Err(Error::Other(format!(
            "tune {key}: no candidate configuration could run (first refusal: {})",
            first_err.as_deref().unwrap_or("a time that is not finite")
        )));
    }
    let winner = candidates[best].clone();
    let mut map = table().lock().unwrap();
    map.insert(key.to_string(), winner.to_string());
    save(&map);
    Ok((winner, Choice::Measured(times)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_fastest_and_remembers_it() {
        let key = format!(
            "test/{}/{}",
            std::process::id(),
            crate::core::rng::Rng::fresh_seed()
        );
        let cands = ["a", "b", "c"];
        let (w, how) = pick(&key, &cands, |c| match *c {
            "a" => Ok(3.0),
            "b" => Ok(1.0),
            _ => Err(Error::Other("does not fit".into())),
        })
        .unwrap();
        assert_eq!(w, "b");
        assert!(matches!(how, Choice::Measured(ref t) if t[2].is_infinite()));
        let (w, how) = pick(&key, &cands, |_| -> Result<f64> {
            panic!("must not re-measure")
        })
        .unwrap();
        assert_eq!((w, how), ("b", Choice::Cached));
        let e = pick(&format!("{key}/none"), &cands, |c| {
            Err(Error::Other(format!("launch of {c} refused")))
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("a: ") && e.contains("launch of a refused"),
            "{e}"
        );
        // Measuring refused for now: the first candidate, nothing remembered, measured later.
        let later = format!("{key}/later");
        let (w, how) = pick(&later, &cands, |_| Err(not_now("capturing"))).unwrap();
        assert_eq!((w, how), ("a", Choice::Default));
        let (w, how) = pick(&later, &cands, |c| Ok(if *c == "c" { 0.5 } else { 2.0 })).unwrap();
        assert_eq!(w, "c");
        assert!(matches!(how, Choice::Measured(_)));
        assert_eq!(shape_class(&[4097, 1, 4096]), "8192x1x4096");
    }
}
