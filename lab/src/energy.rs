//! `batchfs-lab energy [--idle 10s] [--interval 100ms] [--out FILE.jsonl] -- COMMAND ...`: like `perf stat`
//! for energy. Measures the idle baseline, runs the command while sampling every sensor, and prints
//! joules per sensor (total, idle power, above idle), the command's CPU seconds (perf task-clock), and
//! which sensors are unavailable and why.

use anyhow::{bail, Context, Result};
use batchfs::units::parse_duration;
use batchfs_energy::{self as energy, Monitor};
use clap::Args;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Args)]
pub struct EnergyArgs {
    /// Idle time measured first; its mean power is subtracted from every sensor (0 skips it).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "10s")]
    pub idle: Duration,
    /// Sampling interval.
    #[arg(long, value_name = "DURATION", value_parser = batchfs::units::parse_positive_duration,
        default_value = "100ms")]
    pub interval: Duration,
    /// Write the timeline (one JSON sample per line) and a final `{"summary": ...}` line here.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// The command to measure.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// A task-clock counter on the child and everything it forks.
fn task_clock(pid: u32) -> std::io::Result<perf_event::Counter> {
    let mut builder = perf_event::Builder::new().kind(perf_event::events::Software::TASK_CLOCK).observe_pid(pid as i32);
    // Kernel time counts too: CPU seconds of the command, as time(1) reports them.
    builder.inherit(true).exclude_kernel(false).exclude_hv(false);
    let mut counter = builder.build()?;
    counter.enable()?;
    Ok(counter)
}

/// Runs the command; returns its exit code.
pub fn run(args: EnergyArgs) -> Result<i32> {
    let (sensors, unavailable) = energy::detect(Path::new("/"), true, energy::PROBE);
    let names: Vec<String> = sensors.iter().map(|s| s.name().to_owned()).collect();
    let wraps: Vec<Option<f64>> = sensors.iter().map(|s| s.wrap_joules()).collect();
    let max_gap = args.interval.as_secs_f64() * 3.5;
    let (sensors, idle) = if sensors.is_empty() || args.idle.is_zero() {
        (sensors, vec![None; names.len()])
    } else {
        eprintln!("batchfs-lab energy: measuring the idle baseline for {:?}...", args.idle);
        let (sensors, samples) = energy::measure_idle(sensors, args.idle, args.interval);
        let idle = energy::idle_watts(&samples, names.len(), max_gap, &wraps);
        (sensors, idle)
    };
    let log: Option<Box<dyn Write + Send>> = match &args.out {
        Some(path) => Some(Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
        ))),
        None => None,
    };
    let monitor = Monitor::start(sensors, args.interval, None, log);
    let mut child = std::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .spawn()
        .with_context(|| format!("cannot run {:?}", args.command[0]))?;
    let counter = task_clock(child.id());
    let status = child.wait()?;
    let (_, samples) = monitor.stop();
    let cpu = match counter {
        Ok(mut c) => match c.read() {
            Ok(ns) => (Some(ns as f64 / 1e9), "perf task-clock of the command and its children".to_owned()),
            Err(e) => (batchfs_mount::sys::children_cpu_seconds(), format!("rusage (task-clock read failed: {e})")),
        },
        Err(e) => (batchfs_mount::sys::children_cpu_seconds(), format!("rusage (no task-clock counter: {e})")),
    };
    let report = energy::report(&samples, &names, &wraps, &idle, max_gap, cpu, unavailable);
    print!("{}", format_report(&args.command.join(" "), status.code(), &report));
    if let Some(path) = &args.out {
        let mut file = std::fs::OpenOptions::new().append(true).open(path)?;
        serde_json::to_writer(&mut file, &serde_json::json!({ "summary": &report }))?;
        file.write_all(b"\n")?;
    }
    match status.code() {
        Some(code) => Ok(code),
        None => bail!("{:?} was killed by a signal", args.command[0]),
    }
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// The human table.
pub fn format_report(command: &str, code: Option<i32>, r: &energy::Report) -> String {
    let mut out = format!(
        "\nbatchfs-lab energy: `{command}` exited {} after {:.3} s\n",
        code.map_or("by signal".to_owned(), |c| c.to_string()),
        r.duration_s
    );
    if r.sensors.is_empty() {
        out.push_str("no energy sensor available on this machine (see below): no joules reported\n");
    } else {
        out.push_str(&format!(
            "{:<28} {:>10} {:>8} {:>12} {:>10} {:>8} {:>9}\n",
            "sensor", "total J", "idle W", "above idle J", "I/O J", "J/GB", "covered s"
        ));
        for s in &r.sensors {
            out.push_str(&format!(
                "{:<28} {:>10.3} {:>8} {:>12} {:>10} {:>8} {:>9.2}{}\n",
                s.sensor,
                s.total_j,
                num(s.idle_w, 2),
                num(s.above_idle_j, 3),
                num(s.io_above_idle_j, 3),
                num(s.j_per_gb, 1),
                s.covered_s,
                if s.lost { "  (sensor lost mid-run)" } else { "" }
            ));
        }
    }
    let cpu = num(r.cpu_seconds, 3);
    out.push_str(&format!("CPU seconds: {cpu} ({})\n", r.cpu_source));
    if let (Some(bytes), Some(cpu)) = (r.bytes, r.cpu_seconds) {
        if bytes > 0 {
            out.push_str(&format!("CPU seconds per GB: {:.3}\n", cpu / (bytes as f64 / 1e9)));
        }
    }
    if !r.unavailable.is_empty() {
        out.push_str("unavailable:\n");
        for u in &r.unavailable {
            out.push_str(&format!("  {}: {}\n", u.sensor, u.reason));
        }
    }
    out
}
