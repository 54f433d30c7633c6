//! `batchfs-plot RESULTS.csv OUT_DIR [FONT.ttf]`: draws the latency lab's figures as PNG, from the rows
//! `tests/bench/latency_matrix.sh` writes (system, rtt_ms, mode, round, wall_s, mb_per_s, and more
//! columns this tool ignores):
//! - `epoch-vs-rtt.png`: median epoch time against RTT, one line per system, paced and unpaced panels
//!   (EMLIO's figure);
//! - `throughput-vs-link.png`: median throughput against the link rate, with the link rate itself.

use anyhow::{bail, Context, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use std::collections::BTreeMap;

const SYSTEMS: [&str; 5] = ["local", "batchfs", "batchfs-noprefetch", "sshfs", "rclone"];
const COLORS: [RGBColor; 5] =
    [BLACK, RGBColor(0, 114, 178), RGBColor(86, 180, 233), RGBColor(213, 94, 0), RGBColor(0, 158, 115)];

struct Row {
    system: String,
    rtt: f64,
    mode: String,
    wall: f64,
    mbs: f64,
}

type Chart<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// One system's line with its points and legend entry.
fn draw_line<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>, color: RGBColor, label: &str, pts: Vec<(f64, f64)>) -> Result<()> {
    chart
        .draw_series(LineSeries::new(pts.clone(), color.stroke_width(3)))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
    chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
    Ok(())
}

fn draw_legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>) -> Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        bail!("usage: batchfs-plot RESULTS.csv OUT_DIR [FONT.ttf]");
    }
    let font_path = args.get(3).map_or("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", String::as_str);
    let font = std::fs::read(font_path)
        .with_context(|| format!("cannot read font {font_path} (pass a .ttf as the third argument)"))?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(font.into_boxed_slice()))
        .map_err(|_| anyhow::anyhow!("{font_path} is not a usable font"))?;
    let text = std::fs::read_to_string(&args[1]).with_context(|| format!("cannot read {}", args[1]))?;
    let rows: Vec<Row> = text
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            Some(Row {
                system: f[0].into(),
                rtt: f[1].parse().ok()?,
                mode: f[2].into(),
                wall: f[4].parse().ok()?,
                mbs: f[5].parse().ok()?,
            })
        })
        .collect();
    let out = std::path::Path::new(&args[2]);
    std::fs::create_dir_all(out)?;

    // Epoch time against RTT.
    let path = out.join("epoch-vs-rtt.png");
    let root = BitMapBackend::new(&path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    for (panel, mode) in panels.iter().zip(["paced", "unpaced"]) {
        let mut series: BTreeMap<&str, BTreeMap<u64, Vec<f64>>> = BTreeMap::new();
        for r in rows.iter().filter(|r| r.mode == mode) {
            series
                .entry(SYSTEMS.iter().find(|s| **s == r.system).copied().unwrap_or("other"))
                .or_default()
                .entry(r.rtt as u64)
                .or_default()
                .push(r.wall);
        }
        let max_rtt = rows.iter().filter(|r| r.mode == mode).map(|r| r.rtt).fold(1.0, f64::max);
        let max_t = series.values().flat_map(|m| m.values().map(|v| median(v.clone()))).fold(0.1, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("epoch time vs RTT ({mode})"), ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..max_rtt, 0f64..max_t)?;
        chart.configure_mesh().x_desc("RTT (ms)").y_desc("epoch time (s)").label_style(("sans-serif", 16)).draw()?;
        for (i, system) in SYSTEMS.iter().enumerate() {
            let Some(points) = series.get(system) else { continue };
            let pts: Vec<(f64, f64)> = points.iter().map(|(rtt, v)| (*rtt as f64, median(v.clone()))).collect();
            draw_line(&mut chart, COLORS[i], system, pts)?;
        }
        draw_legend(&mut chart)?;
    }
    root.present()?;

    // Throughput against the link rate.
    let capped: Vec<&Row> = rows.iter().filter(|r| r.mode.starts_with("capped-")).collect();
    if !capped.is_empty() {
        let rate_of = |r: &Row| r.mode.trim_start_matches("capped-").parse::<f64>().unwrap_or(0.0) / 8.0;
        let path = out.join("throughput-vs-link.png");
        let root = BitMapBackend::new(&path, (800, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let max_rate = capped.iter().map(|r| rate_of(r)).fold(1.0, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption("throughput vs link rate (10 ms RTT, unpaced)", ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..max_rate, 0f64..max_rate)?;
        chart
            .configure_mesh()
            .x_desc("link rate (MB/s)")
            .y_desc("throughput (MB/s)")
            .label_style(("sans-serif", 16))
            .draw()?;
        chart
            .draw_series(LineSeries::new(vec![(0.0, 0.0), (max_rate, max_rate)], BLACK.mix(0.4).stroke_width(1)))?
            .label("link rate")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.4)));
        for (i, system) in SYSTEMS.iter().enumerate() {
            let mut by_rate: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
            for r in capped.iter().filter(|r| r.system == *system) {
                by_rate.entry(rate_of(r) as u64).or_default().push(r.mbs);
            }
            if by_rate.is_empty() {
                continue;
            }
            let pts: Vec<(f64, f64)> = by_rate.iter().map(|(rate, v)| (*rate as f64, median(v.clone()))).collect();
            draw_line(&mut chart, COLORS[i], system, pts)?;
        }
        draw_legend(&mut chart)?;
        root.present()?;
    }
    println!("wrote {}", out.display());
    Ok(())
}
