//! Output of check and bench: aligned terminal tables, JSON, and an SVG chart of a ladder.

use super::bench::BenchRecord;
use super::check::CheckRecord;
use std::fmt::Write;

/// A plain aligned text table.
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Table {
            headers: headers.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }
    pub fn render(&self) -> String {
        let n = self.headers.len();
        let mut w: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(n) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate().take(n) {
                let pad = w[i] - c.chars().count();
                if i > 0 {
                    s.push_str("  ");
                }
                s.push_str(c);
                if i + 1 < n {
                    s.push_str(&" ".repeat(pad));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = line(&self.headers) + "\n";
        out += &w
            .iter()
            .map(|&x| "-".repeat(x))
            .collect::<Vec<_>>()
            .join("  ");
        out.push('\n');
        for r in &self.rows {
            out += &line(r);
            out.push('\n');
        }
        out
    }
}

fn sci(v: f64) -> String {
    if !v.is_finite() {
        "inf".into()
    } else if v == 0.0 {
        "0".into()
    } else {
        format!("{v:.1e}")
    }
}

pub fn check_table(records: &[CheckRecord]) -> String {
    let mut t = Table::new(&[
        "op", "variant", "device", "dtype", "shape", "error", "tol", "pass", "note",
    ]);
    for r in records {
        t.row(vec![
            r.op.clone(),
            r.variant.clone(),
            r.device.clone(),
            if r.precision.name() != r.dtype {
                format!("{} ({})", r.dtype, r.precision.name())
            } else {
                r.dtype.clone()
            },
            r.shape.clone(),
            sci(r.error),
            sci(r.tolerance),
            if r.pass { "ok".into() } else { "FAIL".into() },
            r.note.clone(),
        ]);
    }
    t.render()
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map(f).unwrap_or_else(|| "-".into())
}

/// Human rate: TFLOP/s above 1, GFLOP/s below.
pub fn rate(tflops: f64) -> String {
    if tflops >= 1.0 {
        format!("{tflops:.1} TFLOP/s")
    } else {
        format!("{:.1} GFLOP/s", tflops * 1e3)
    }
}

/// The bench table: every column (`wide`), or the compact default — median time, rate, GB/s,
/// % of ceiling, × base, × peer and a note cut to one short line, without the columns that hold
/// nothing for these records (e.g. registers and occupancy on the CPU).
pub fn bench_table(records: &[BenchRecord], wide: bool) -> String {
    let full = bench_table_full(records);
    if wide {
        return full.render();
    }
    const DROP: [&str; 5] = ["min", "max", "regs", "smem", "occ"];
    const NOTE_CHARS: usize = 56;
    let keep: Vec<usize> = (0..full.headers.len())
        .filter(|&i| {
            let h = full.headers[i].as_str();
            !DROP.contains(&h)
                && (i < 5 || full.rows.iter().any(|r| r[i] != "-" && !r[i].is_empty()))
        })
        .collect();
    let last = full.headers.len() - 1;
    let mut t = Table {
        headers: keep.iter().map(|&i| full.headers[i].clone()).collect(),
        rows: Vec::new(),
    };
    for r in &full.rows {
        t.row(
            keep.iter()
                .map(|&i| {
                    let c = &r[i];
                    if i == last && c.chars().count() > NOTE_CHARS {
                        c.chars().take(NOTE_CHARS - 1).collect::<String>() + "…"
                    } else {
                        c.clone()
                    }
                })
                .collect(),
        );
    }
    t.render()
}

/// The widest case and variant cells of the summary: with them it stays within ~140 columns (one
/// screen) whatever a family calls its cases; the table above it has the whole names.
const SUMMARY_CASE_CHARS: usize = 34;
const SUMMARY_NAME_CHARS: usize = 18;

/// `s` cut to `n` characters, the last one an ellipsis when cut.
fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).collect::<String>() + "…"
    }
}

/// A record's device as (id, name): `cuda:0 (NVIDIA H200)` → (`cuda:0`, `NVIDIA H200`).
fn device_id_and_name(device: &str) -> (&str, &str) {
    match device.split_once(" (") {
        Some((id, name)) => (id, name.strip_suffix(')').unwrap_or(name)),
        None => (device, ""),
    }
}

/// One line per (device, op): the largest case it timed (most FLOPs, else most bytes) and the
/// fastest variant there — its time, rate and × the family's baseline — with the peer it was
/// compared with and × that peer where the family has one; then the devices' names (the rows
/// carry only their ids, to stay on one screen). `is_variant` tells the ladder's rows from the
/// others a bench adds (a bare GEMM beside linear's fused rows, a vendor mode beside its peer):
/// where a family has ladder rows, the case and the best are picked among them alone.
pub fn bench_summary(records: &[BenchRecord], is_variant: &dyn Fn(&BenchRecord) -> bool) -> String {
    let work = |r: &BenchRecord| if r.flops > 0.0 { r.flops } else { r.bytes };
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in records.iter().filter(|r| !r.is_peer) {
        let k = (r.device.clone(), r.op.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut t = Table::new(&[
        "device",
        "op",
        "largest case",
        "best",
        "median ms",
        "rate",
        "× base",
        "peer",
        "× peer",
    ]);
    let mut devices: Vec<(&str, &str)> = Vec::new();
    for (device, op) in &keys {
        let mut mine: Vec<&BenchRecord> = records
            .iter()
            .filter(|r| !r.is_peer && &r.device == device && &r.op == op)
            .collect();
        if mine.iter().any(|r| is_variant(r)) {
            mine.retain(|r| is_variant(r));
        }
        let Some(big) = mine
            .iter()
            .copied()
            .max_by(|a, b| work(a).total_cmp(&work(b)))
        else {
            continue;
        };
        let best = mine
            .iter()
            .copied()
            .filter(|r| r.dtype == big.dtype && r.shape == big.shape)
            .min_by(|a, b| a.median_ms.total_cmp(&b.median_ms))
            .unwrap_or(big);
        let (id, name) = device_id_and_name(device);
        if !devices.iter().any(|(d, _)| *d == id) {
            devices.push((id, name));
        }
        t.row(vec![
            id.to_string(),
            op.clone(),
            clip(
                &format!("{} {}", best.dtype, best.shape),
                SUMMARY_CASE_CHARS,
            ),
            clip(&best.variant, SUMMARY_NAME_CHARS),
            format!("{:.4}", best.median_ms),
            if best.flops > 0.0 {
                rate(best.tflops)
            } else {
                format!("{:.1} GB/s", best.gbps)
            },
            opt(best.speedup_vs_baseline, |v| format!("{v:.2}")),
            if best.ratio_to_peer.is_some() && !best.peer.is_empty() {
                clip(&best.peer, SUMMARY_NAME_CHARS)
            } else {
                "-".into()
            },
            opt(best.ratio_to_peer, |v| format!("{v:.2}")),
        ]);
    }
    let mut out = t.render();
    let names: Vec<String> = devices
        .iter()
        .filter(|(_, name)| !name.is_empty())
        .map(|(id, name)| format!("{id} = {name}"))
        .collect();
    if !names.is_empty() {
        out += &format!("devices: {}\n", names.join("; "));
    }
    out
}

fn bench_table_full(records: &[BenchRecord]) -> Table {
    let mut t = Table::new(&[
        "op",
        "variant",
        "dtype",
        "shape",
        "median ms",
        "min",
        "max",
        "rate",
        "GB/s",
        "% ceil",
        "× base",
        "× peer",
        "regs",
        "smem",
        "occ",
        "config / note",
    ]);
    for r in records {
        let mut note = r.config.clone();
        if !r.note.is_empty() {
            if !note.is_empty() {
                note.push_str("; ");
            }
            note.push_str(&r.note);
        }
        t.row(vec![
            r.op.clone(),
            if r.is_peer {
                format!("{} (peer)", r.variant)
            } else {
                r.variant.clone()
            },
            r.dtype.clone(),
            r.shape.clone(),
            format!("{:.4}", r.median_ms),
            format!("{:.4}", r.min_ms),
            format!("{:.4}", r.max_ms),
            if r.flops > 0.0 {
                rate(r.tflops)
            } else {
                "-".into()
            },
            format!("{:.1}", r.gbps),
            opt(r.pct_of_ceiling, |v| format!("{v:.1}%")),
            opt(r.speedup_vs_baseline, |v| format!("{v:.2}")),
            opt(r.ratio_to_peer, |v| format!("{v:.2}")),
            r.registers
                .map(|v| v.to_string())
                .unwrap_or_else(|| "-".into()),
            r.smem_bytes
                .map(|v| v.to_string())
                .unwrap_or_else(|| "-".into()),
            opt(r.occupancy, |v| format!("{:.0}%", v * 100.0)),
            note,
        ]);
    }
    t
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG document's opening: its size, a white background and the title line (close it with
/// `</svg>`).
fn svg_open(width: f64, height: f64, title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="24" font-size="16" font-weight="bold">{}</text>"#,
        esc(title)
    );
    s
}

/// A horizontal bar chart of the ladder: one panel per (device, op, dtype, shape), one bar per
/// variant, rate on a log axis (a naive CPU loop and a tensor-core kernel differ by 10⁴).
pub fn ladder_svg(records: &[BenchRecord], title: &str) -> String {
    let mut groups: Vec<(String, Vec<&BenchRecord>)> = Vec::new();
    for r in records.iter().filter(|r| r.flops > 0.0 || r.gbps > 0.0) {
        let key = format!("{} · {} · {} · {}", r.device, r.op, r.dtype, r.shape);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    let value = |r: &BenchRecord| {
        if r.flops > 0.0 {
            r.tflops * 1e3
        } else {
            r.gbps
        }
    };
    let unit = |g: &[&BenchRecord]| {
        if g.iter().any(|r| r.flops > 0.0) {
            "GFLOP/s"
        } else {
            "GB/s"
        }
    };
    let (lw, bw, bh, gap) = (170.0, 560.0, 18.0, 34.0);
    let width = lw + bw + 190.0;
    let height: f64 = 50.0
        + groups
            .iter()
            .map(|(_, g)| gap + bh * g.len() as f64)
            .sum::<f64>();
    let mut s = svg_open(width, height, title);
    let mut y = 50.0;
    for (key, g) in &groups {
        let vmax = g.iter().map(|r| value(r)).fold(1e-9, f64::max);
        let vmin = g
            .iter()
            .map(|r| value(r))
            .filter(|v| *v > 0.0)
            .fold(vmax, f64::min);
        let lo = (vmin / 2.0).log10().floor();
        let hi = vmax.log10().ceil().max(lo + 1.0);
        let _ = writeln!(
            s,
            r#"<text x="10" y="{}" font-weight="bold">{} ({}, log scale)</text>"#,
            y + 14.0,
            esc(key),
            unit(g)
        );
        y += gap - 8.0;
        for r in g {
            let v = value(r).max(10f64.powf(lo));
            let len = bw * (v.log10() - lo) / (hi - lo);
            let color = if r.is_peer {
                "#888888"
            } else if r.device.starts_with("cuda") {
                "#2e7d32"
            } else {
                "#1565c0"
            };
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
                lw - 6.0,
                y + 13.0,
                esc(&r.variant)
            );
            let _ = writeln!(
                s,
                r#"<rect x="{lw}" y="{}" width="{len:.1}" height="{}" fill="{color}"/>"#,
                y + 2.0,
                bh - 4.0
            );
            let ratio = r
                .ratio_to_peer
                .filter(|_| !r.is_peer)
                .map(|x| format!(" ({x:.2}× peer)"))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}">{:.1}{}</text>"#,
                lw + len + 6.0,
                y + 13.0,
                value(r),
                esc(&ratio)
            );
            y += bh;
        }
        y += 8.0;
    }
    s.push_str("</svg>\n");
    s
}

/// (m, n, k) from a GEMM shape label (`[batch×]m×n×k LAYOUT`): the last three numbers of the
/// first word.
pub fn gemm_mnk(shape: &str) -> Option<(usize, usize, usize)> {
    let dims: Vec<usize> = shape
        .split_whitespace()
        .next()?
        .split('×')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    match dims[..] {
        [.., m, n, k] => Some((m, n, k)),
        _ => None,
    }
}

/// One sweep cell: dtype, (m, n, k), the default path's ratio to the faster vendor peer.
fn sweep_cells<'a>(
    records: &'a [BenchRecord],
    row: &str,
) -> Vec<(&'a str, (usize, usize, usize), f64)> {
    records
        .iter()
        .filter(|r| r.variant == row && !r.is_peer)
        .filter_map(|r| Some((r.dtype.as_str(), gemm_mnk(&r.shape)?, r.ratio_to_peer?)))
        .collect()
}

/// The sweep per dtype: cells, the geometric mean of the default path's ratios to the faster
/// vendor peer, the worst cell, and the cells below 0.9×.
pub fn sweep_summary(records: &[BenchRecord], row: &str) -> String {
    let cells = sweep_cells(records, row);
    let mut dtypes: Vec<&str> = cells.iter().map(|c| c.0).collect();
    dtypes.dedup();
    let mut s = String::new();
    for d in dtypes {
        let mine: Vec<_> = cells.iter().filter(|c| c.0 == d).collect();
        let geo = (mine.iter().map(|c| c.2.ln()).sum::<f64>() / mine.len() as f64).exp();
        let worst = mine
            .iter()
            .min_by(|a, b| a.2.total_cmp(&b.2))
            .expect("a dtype has cells");
        let below = mine.iter().filter(|c| c.2 < 0.9).count();
        let (m, n, k) = worst.1;
        let _ = writeln!(
            s,
            "  {d}: {} cells, geometric mean {geo:.2}× the faster of cuBLAS/cuBLASLt; worst {m}×{n}×{k} {:.2}×; {below} below 0.90×",
            mine.len(),
            worst.2
        );
    }
    s
}

/// Fill of a sweep cell: red below 0.5×, through orange and yellow to green at ≥ 1.2×.
fn ratio_color(r: f64) -> String {
    let t = ((r - 0.5) / 0.7).clamp(0.0, 1.0);
    let (r0, g0, b0) = if t < 0.5 {
        (0.85, 0.25 + 1.2 * t, 0.2)
    } else {
        (0.85 - 1.2 * (t - 0.5), 0.85, 0.2 + 0.3 * (t - 0.5))
    };
    let h = |x: f64| (x.clamp(0.0, 1.0) * 255.0).round() as u8;
    format!("#{:02x}{:02x}{:02x}", h(r0), h(g0), h(b0))
}

/// A heat map of the sweep: one panel per dtype, rows m, columns (n, k), each cell the default
/// path's ratio to the faster vendor peer (> 1: faster), with the summary line under it.
pub fn sweep_svg(records: &[BenchRecord], row: &str, title: &str) -> String {
    let cells = sweep_cells(records, row);
    let mut dtypes: Vec<&str> = cells.iter().map(|c| c.0).collect();
    dtypes.dedup();
    let (cw, ch, lw, top) = (96.0, 24.0, 70.0, 50.0);
    let mut panels = String::new();
    let mut y = top;
    let mut width: f64 = 640.0;
    for d in &dtypes {
        let mine: Vec<_> = cells.iter().filter(|c| c.0 == *d).collect();
        let mut ms: Vec<usize> = mine.iter().map(|c| c.1 .0).collect();
        ms.sort_unstable();
        ms.dedup();
        let mut nks: Vec<(usize, usize)> = Vec::new();
        for c in &mine {
            if !nks.contains(&(c.1 .1, c.1 .2)) {
                nks.push((c.1 .1, c.1 .2));
            }
        }
        width = width.max(lw + cw * nks.len() as f64 + 20.0);
        let _ = writeln!(
            panels,
            r#"<text x="10" y="{}" font-weight="bold">{} — rows m, columns n×k (B stored [n, k]); × the faster of cuBLAS/cuBLASLt</text>"#,
            y + 14.0,
            esc(d)
        );
        y += 24.0;
        for (j, (n, k)) in nks.iter().enumerate() {
            let _ = writeln!(
                panels,
                r#"<text x="{}" y="{}" text-anchor="middle">{n}×{k}</text>"#,
                lw + cw * (j as f64 + 0.5),
                y + 14.0
            );
        }
        y += ch;
        for m in &ms {
            let _ = writeln!(
                panels,
                r#"<text x="{}" y="{}" text-anchor="end">{m}</text>"#,
                lw - 8.0,
                y + 16.0
            );
            for (j, nk) in nks.iter().enumerate() {
                let x = lw + cw * j as f64;
                if let Some(c) = mine.iter().find(|c| c.1 == (*m, nk.0, nk.1)) {
                    let _ = writeln!(
                        panels,
                        r#"<rect x="{x}" y="{y}" width="{}" height="{}" fill="{}" stroke="white"/><text x="{}" y="{}" text-anchor="middle">{:.2}</text>"#,
                        cw,
                        ch,
                        ratio_color(c.2),
                        x + cw / 2.0,
                        y + 16.0,
                        c.2
                    );
                }
            }
            y += ch;
        }
        let summary = sweep_summary(records, row);
        if let Some(line) = summary.lines().find(|l| l.trim_start().starts_with(*d)) {
            let _ = writeln!(
                panels,
                r#"<text x="10" y="{}">{}</text>"#,
                y + 18.0,
                esc(line.trim())
            );
        }
        y += 40.0;
    }
    let mut s = svg_open(width, y, title);
    s.push_str(&panels);
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_and_svg_is_wellformed() {
        let mut t = Table::new(&["a", "bbb"]);
        t.row(vec!["xx".into(), "y".into()]);
        let s = t.render();
        assert!(s.starts_with("a   bbb\n--  ---\nxx  y"), "{s}");
        let r = BenchRecord {
            device: "cpu".into(),
            op: "matmul".into(),
            variant: "naive<1>".into(),
            flops: 1e9,
            tflops: 0.001,
            ..Default::default()
        };
        let svg = ladder_svg(&[r], "t");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("naive&lt;1&gt;"));
    }

    #[test]
    fn sweep_summary_and_heat_map() {
        let r = |dtype: &str, shape: &str, ratio: f64| BenchRecord {
            variant: "default".into(),
            dtype: dtype.into(),
            shape: shape.into(),
            ratio_to_peer: Some(ratio),
            ..Default::default()
        };
        let recs = vec![
            r("bf16", "1×4096×4096 NT", 0.5),
            r("bf16", "4097×4097×4097 NT", 2.0),
            r("bf16", "8192×768×768 NT", 0.8),
            BenchRecord {
                variant: "cublas".into(),
                is_peer: true,
                ..r("bf16", "1×4096×4096 NT", 1.0)
            },
        ];
        assert_eq!(gemm_mnk("2×7×9×11 NN"), Some((7, 9, 11)));
        assert_eq!(gemm_mnk("7×9"), None);
        let s = sweep_summary(&recs, "default");
        assert!(s.contains("bf16: 3 cells"), "{s}");
        assert!(s.contains("geometric mean 0.93×"), "{s}");
        assert!(s.contains("worst 1×4096×4096 0.50×"), "{s}");
        assert!(s.contains("2 below 0.90×"), "{s}");
        let svg = sweep_svg(&recs, "default", "t");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<rect x=").count(), 3);
        assert!(svg.contains(">2.00<") && svg.contains("4097×4097"));
        assert_ne!(ratio_color(0.4), ratio_color(1.3));
    }

    /// The summary takes each family's largest case and its fastest non-peer variant, names the
    /// peer and the ratio to it where the family has one, cuts long cells to stay on one screen,
    /// and names each device once; the compact table leaves out the columns no record fills.
    #[test]
    fn summary_picks_the_largest_case_and_its_fastest_variant() {
        let rec = |op: &str, v: &str, shape: &str, flops: f64, ms: f64, peer: bool| BenchRecord {
            device: "cpu (Some CPU)".into(),
            op: op.into(),
            variant: v.into(),
            dtype: "f32".into(),
            shape: shape.into(),
            flops,
            median_ms: ms,
            tflops: flops / (ms * 1e9),
            is_peer: peer,
            speedup_vs_baseline: Some(2.0),
            ..Default::default()
        };
        let mut recs = vec![
            rec("matmul", "naive", "64³", 5e5, 1.0, false),
            rec("matmul", "naive", "512³", 2.7e8, 90.0, false),
            rec("matmul", "parallel", "512³", 2.7e8, 9.0, false),
            rec("matmul", "gemm-crate", "512³", 2.7e8, 4.0, true),
            rec("norm", "parallel", "8×8", 0.0, 0.1, false),
            rec("moe", "parallel", &"T1024 ".repeat(20), 1e9, 2.0, false),
            // A row beside the ladder (linear's bare GEMM): faster, in a larger case, not picked.
            rec("matmul", "bare", "1024³", 2.1e9, 1.0, false),
        ];
        crate::core::harness::bench::relate(&mut recs[1..4], "naive", None);
        let s = bench_summary(&recs, &|r| r.variant != "bare");
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 6, "{s}");
        let matmul = lines[2];
        assert!(
            matmul.starts_with("cpu ") && !matmul.contains("Some CPU"),
            "{s}"
        );
        assert!(
            matmul.contains("512³") && matmul.contains("parallel"),
            "{s}"
        );
        // The peer is named as the peer, never picked as the best; 4 ms / 9 ms = 0.44×.
        assert!(
            matmul.contains("gemm-crate") && matmul.ends_with("0.44"),
            "{s}"
        );
        assert!(lines[3].contains("norm") && lines[3].ends_with("-"), "{s}");
        assert!(lines[4].contains("…"), "{s}");
        assert!(lines.iter().all(|l| l.chars().count() <= 140), "{s}");
        assert_eq!(lines[5], "devices: cpu = Some CPU", "{s}");
        // Without a ladder row in the family, its other rows stand in.
        let s = bench_summary(&recs, &|_| false);
        assert!(s.lines().nth(2).unwrap().contains("bare"), "{s}");
        let compact = bench_table(&recs, false);
        assert!(
            !compact.contains("regs") && !compact.contains("occ"),
            "{compact}"
        );
        assert!(bench_table(&recs, true).contains("regs"));
    }
}
