//! Energy monitor: joules per sensor over a run, the idle baseline subtracted, attributed to the I/O stage
//! by the bytes moved in each sampling interval. Honest where no sensor exists: an absent sensor is
//! reported as unavailable with the reason, never as a number.
//!
//! Sensors (detected once; each optional):
//! - CPU package / DRAM / platform energy from RAPL through `perf_event_open` on the `power` PMU
//!   (`/sys/devices/power`: its `type`, one event per `events/energy-*`, scaled by the `.scale` file),
//!   opened once per socket with pid -1;
//! - else RAPL through powercap sysfs (`/sys/class/powercap/intel-rapl*/energy_uj`, wrapping at
//!   `max_energy_range_uj`);
//! - GPU energy through NVML (`total_energy_consumption`, mJ, Volta and newer; else `power_usage`
//!   samples integrated over time). NVML is loaded at run time, so no GPU is needed to build.
//!
//! The arithmetic ([`integrate`], [`report`]) works on recorded traces, so tests replay exact inputs.

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What a sensor reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reading {
    /// A cumulative energy counter, joules (may wrap).
    Energy(f64),
    /// Instantaneous power, watts.
    Power(f64),
}

/// An energy or power sensor.
pub trait Sensor: Send {
    /// Stable name (`cpu-energy-pkg-0`, `powercap-package-0`, `gpu-0`).
    fn name(&self) -> &str;
    /// One reading, or why none could be taken.
    fn read(&mut self) -> Result<Reading, ReadError>;
    /// Joules after which a cumulative counter wraps to zero, if it does.
    fn wrap_joules(&self) -> Option<f64> {
        None
    }
}

/// Why a sensor gave no reading, with the cause.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read the perf counter")]
    Perf(#[source] std::io::Error),
    #[error("cannot read {path}")]
    File { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a number of microjoules")]
    NotANumber { path: PathBuf },
    #[error("NVML")]
    Nvml(#[from] nvml_wrapper::error::NvmlError),
}

/// A sensor that could not be used, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unavailable {
    pub sensor: String,
    pub reason: String,
}

/// RAPL through perf: one counter of the `power` PMU on one socket.
struct PerfEnergy {
    name: String,
    counter: perf_event::Counter,
    scale: f64,
}

impl Sensor for PerfEnergy {
    fn name(&self) -> &str {
        &self.name
    }

    fn read(&mut self) -> Result<Reading, ReadError> {
        self.counter.read().map(|raw| Reading::Energy(raw as f64 * self.scale)).map_err(ReadError::Perf)
    }
}

/// RAPL through powercap sysfs.
struct PowercapEnergy {
    name: String,
    path: PathBuf,
    wrap: Option<f64>,
}

impl Sensor for PowercapEnergy {
    fn name(&self) -> &str {
        &self.name
    }

    fn read(&mut self) -> Result<Reading, ReadError> {
        let path = || self.path.clone();
        let text = std::fs::read_to_string(&self.path).map_err(|source| ReadError::File { path: path(), source })?;
        let uj: f64 = text.trim().parse().map_err(|_| ReadError::NotANumber { path: path() })?;
        Ok(Reading::Energy(uj / 1e6))
    }

    fn wrap_joules(&self) -> Option<f64> {
        self.wrap
    }
}

/// A GPU through NVML: the energy counter where the GPU has one, else power samples.
struct NvmlGpu {
    name: String,
    nvml: Arc<nvml_wrapper::Nvml>,
    index: u32,
    energy_counter: bool,
}

impl Sensor for NvmlGpu {
    fn name(&self) -> &str {
        &self.name
    }

    fn read(&mut self) -> Result<Reading, ReadError> {
        let device = self.nvml.device_by_index(self.index)?;
        Ok(match self.energy_counter {
            true => Reading::Energy(device.total_energy_consumption()? as f64 / 1e3),
            false => Reading::Power(f64::from(device.power_usage()?) / 1e3),
        })
    }
}

/// An error and its causes, as one line (`what: why: ...`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

fn read_trim(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

/// CPUs listed in a cpumask file such as `0,16` or `0-1`: the first CPU of each range.
fn first_cpus(mask: &str) -> Vec<usize> {
    mask.split(',').filter_map(|r| r.split('-').next()?.trim().parse().ok()).collect()
}

fn detect_perf(root: &Path, sensors: &mut Vec<Box<dyn Sensor>>, missing: &mut Vec<Unavailable>) {
    let pmu = root.join("sys/devices/power");
    let Some(pmu_type) = read_trim(&pmu.join("type")).and_then(|t| t.parse::<u32>().ok()) else {
        missing.push(Unavailable {
            sensor: "rapl (perf)".into(),
            reason: "no power PMU (/sys/devices/power/type): the CPU or the VM does not expose RAPL".into(),
        });
        return;
    };
    let cpus = first_cpus(&read_trim(&pmu.join("cpumask")).unwrap_or_else(|| "0".into()));
    let mut events: Vec<String> = std::fs::read_dir(pmu.join("events"))
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    events.retain(|e| e.starts_with("energy-") && !e.contains('.'));
    events.sort();
    if events.is_empty() {
        missing
            .push(Unavailable { sensor: "rapl (perf)".into(), reason: "the power PMU lists no energy events".into() });
    }
    for event in events {
        let config = read_trim(&pmu.join("events").join(&event)).and_then(|c| {
            c.strip_prefix("event=").and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok())
        });
        let scale = read_trim(&pmu.join("events").join(format!("{event}.scale"))).and_then(|s| s.parse::<f64>().ok());
        let (Some(config), Some(scale)) = (config, scale) else {
            missing
                .push(Unavailable { sensor: format!("cpu-{event}"), reason: "unreadable event or scale file".into() });
            continue;
        };
        for (socket, &cpu) in cpus.iter().enumerate() {
            let name = format!("cpu-{event}-{socket}");
            let mut builder = perf_event::Builder::new().any_pid().one_cpu(cpu);
            builder.attrs_mut().type_ = pmu_type;
            builder.attrs_mut().config = config;
            // RAPL counts the whole package: the PMU rejects events that exclude kernel or hypervisor
            // time (the builder's default) with EINVAL.
            builder.exclude_kernel(false).exclude_hv(false);
            match builder.build().and_then(|mut c| c.enable().map(|_| c)) {
                Ok(counter) => {
                    let mut sensor = PerfEnergy { name, counter, scale };
                    // Some VMs list the PMU but the counter never moves or cannot be read.
                    match sensor.read() {
                        Ok(_) => sensors.push(Box::new(sensor)),
                        Err(e) => {
                            let reason = format!("read failed: {}", chain(&e));
                            missing.push(Unavailable { sensor: sensor.name, reason })
                        }
                    }
                }
                Err(e) => missing.push(Unavailable { sensor: name, reason: format!("perf_event_open failed: {e}") }),
            }
        }
    }
}

fn detect_powercap(root: &Path, sensors: &mut Vec<Box<dyn Sensor>>, missing: &mut Vec<Unavailable>) {
    let dir = root.join("sys/class/powercap");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        missing.push(Unavailable { sensor: "rapl (powercap)".into(), reason: format!("no {}", dir.display()) });
        return;
    };
    let mut zones: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("intel-rapl:")))
        .collect();
    zones.sort();
    if zones.is_empty() {
        missing.push(Unavailable { sensor: "rapl (powercap)".into(), reason: "no intel-rapl zones".into() });
    }
    for zone in zones {
        let zone_id = zone.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let name = format!("powercap-{}-{}", read_trim(&zone.join("name")).unwrap_or_else(|| "zone".into()), zone_id);
        let path = zone.join("energy_uj");
        let wrap = read_trim(&zone.join("max_energy_range_uj")).and_then(|v| v.parse::<f64>().ok()).map(|uj| uj / 1e6);
        let mut sensor = PowercapEnergy { name, path, wrap };
        match sensor.read() {
            Ok(_) => sensors.push(Box::new(sensor)),
            Err(e) => missing.push(Unavailable { sensor: sensor.name, reason: chain(&e) }),
        }
    }
}

fn detect_nvml(sensors: &mut Vec<Box<dyn Sensor>>, missing: &mut Vec<Unavailable>) {
    let nvml = match nvml_wrapper::Nvml::init() {
        Ok(n) => Arc::new(n),
        Err(e) => {
            missing.push(Unavailable {
                sensor: "gpu".into(),
                reason: format!("NVML unavailable ({e}): no NVIDIA driver or GPU"),
            });
            return;
        }
    };
    let count = nvml.device_count().unwrap_or(0);
    if count == 0 {
        missing.push(Unavailable { sensor: "gpu".into(), reason: "NVML reports no GPU".into() });
    }
    for index in 0..count {
        let name = format!("gpu-{index}");
        let Ok(device) = nvml.device_by_index(index) else {
            missing.push(Unavailable { sensor: name, reason: "cannot open the device".into() });
            continue;
        };
        let energy_counter = device.total_energy_consumption().is_ok();
        if !energy_counter && device.power_usage().is_err() {
            missing.push(Unavailable { sensor: name, reason: "neither an energy counter nor power readings".into() });
            continue;
        }
        sensors.push(Box::new(NvmlGpu { name, nvml: nvml.clone(), index, energy_counter }));
    }
}

/// Detects every sensor under the filesystem root `root` (`/` normally; tests pass a fake tree). With a
/// nonzero `probe`, energy counters are read twice that far apart and dropped if they did not advance:
/// some VMs expose RAPL counters that never move, and a counter that never moves would report 0 J.
pub fn detect(root: &Path, gpu: bool, probe: Duration) -> (Vec<Box<dyn Sensor>>, Vec<Unavailable>) {
    let (mut sensors, mut missing) = (Vec::new(), Vec::new());
    detect_perf(root, &mut sensors, &mut missing);
    if sensors.is_empty() {
        detect_powercap(root, &mut sensors, &mut missing);
    }
    if !probe.is_zero() && !sensors.is_empty() {
        let before: Vec<_> = sensors.iter_mut().map(|s| s.read().ok()).collect();
        std::thread::sleep(probe);
        let mut kept = Vec::new();
        for (mut s, b) in sensors.into_iter().zip(before) {
            match (b, s.read().ok()) {
                (Some(Reading::Energy(a)), Some(Reading::Energy(c))) if a == c => missing.push(Unavailable {
                    sensor: s.name().to_owned(),
                    reason: format!(
                        "the counter did not advance in {probe:?} (RAPL exposed but not counting, as in some VMs)"
                    ),
                }),
                _ => kept.push(s),
            }
        }
        sensors = kept;
    }
    if gpu {
        detect_nvml(&mut sensors, &mut missing);
    }
    (sensors, missing)
}

/// How long [`detect`] watches energy counters before trusting them.
pub const PROBE: Duration = Duration::from_millis(200);

/// One sampling instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the monitor started (monotonic clock).
    pub t: f64,
    /// Wall-clock time, milliseconds since the Unix epoch.
    pub wall_ms: u64,
    /// One reading per sensor, `None` where the read failed.
    pub readings: Vec<Option<Reading>>,
    /// Cumulative bytes moved by the measured I/O stage, when known.
    pub bytes: Option<u64>,
}

/// Energy of one sensor over a trace.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Integrated {
    pub joules: f64,
    /// Seconds of the trace the energy covers.
    pub covered_s: f64,
    /// Joules per sampling interval (interval `i` runs from sample `i` to `i + 1`; `None`: not covered).
    pub intervals: Vec<Option<f64>>,
    /// Samples whose read failed.
    pub missed: usize,
    pub wraps: u32,
    /// The sensor stopped answering before the end.
    pub lost: bool,
}

/// Integrates one sensor's readings `(t, reading)`: cumulative counters by differences (a drop is a
/// wrap when the range is known, else a reset whose interval is not counted), power by the trapezoid
/// rule over gaps no longer than `max_gap` seconds.
pub fn integrate(trace: &[(f64, Option<Reading>)], wrap: Option<f64>, max_gap: f64) -> Integrated {
    let mut out = Integrated { intervals: vec![None; trace.len().saturating_sub(1)], ..Default::default() };
    let mut last: Option<(usize, f64, Reading)> = None;
    for (i, &(t, reading)) in trace.iter().enumerate() {
        let Some(r) = reading else {
            out.missed += 1;
            continue;
        };
        if let Some((j, t0, r0)) = last {
            let dt = t - t0;
            let joules = match (r0, r) {
                (Reading::Energy(a), Reading::Energy(b)) if b >= a => Some(b - a),
                (Reading::Energy(a), Reading::Energy(b)) => wrap.map(|range| {
                    out.wraps += 1;
                    b + range - a
                }),
                (Reading::Power(a), Reading::Power(b)) if dt <= max_gap => Some((a + b) / 2.0 * dt),
                _ => None,
            };
            if let Some(e) = joules {
                out.joules += e;
                out.covered_s += dt;
                // Spread over the intervals between the two good samples, by time.
                let span = trace[i].0 - trace[j].0;
                for k in j..i {
                    let share = if span > 0.0 { (trace[k + 1].0 - trace[k].0) / span } else { 0.0 };
                    out.intervals[k] = Some(out.intervals[k].unwrap_or(0.0) + e * share);
                }
            }
        }
        last = Some((i, t, r));
    }
    out.lost = trace.last().is_some_and(|(_, r)| r.is_none()) && last.is_some();
    out
}

/// One sensor's line of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SensorReport {
    pub sensor: String,
    pub total_j: f64,
    /// Mean idle power measured before the run, watts (`None` without a baseline).
    pub idle_w: Option<f64>,
    /// Total minus idle power times the covered time.
    pub above_idle_j: Option<f64>,
    /// Energy above idle during intervals in which the I/O stage moved bytes.
    pub io_above_idle_j: Option<f64>,
    /// `io_above_idle_j` per GB moved.
    pub j_per_gb: Option<f64>,
    pub covered_s: f64,
    pub missed_samples: usize,
    pub wraps: u32,
    pub lost: bool,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub duration_s: f64,
    /// Seconds the I/O stage was moving bytes (intervals with bytes), when bytes are known.
    pub io_active_s: Option<f64>,
    pub bytes: Option<u64>,
    pub cpu_seconds: Option<f64>,
    /// How CPU seconds were measured, or why not.
    pub cpu_source: String,
    pub sensors: Vec<SensorReport>,
    pub unavailable: Vec<Unavailable>,
}

/// Per-sensor traces of a sample list.
fn traces(samples: &[Sample], sensor: usize) -> Vec<(f64, Option<Reading>)> {
    samples.iter().map(|s| (s.t, s.readings.get(sensor).copied().flatten())).collect()
}

/// Mean power per sensor over an idle recording.
pub fn idle_watts(samples: &[Sample], sensors: usize, max_gap: f64, wraps: &[Option<f64>]) -> Vec<Option<f64>> {
    (0..sensors)
        .map(|i| {
            let e = integrate(&traces(samples, i), wraps.get(i).copied().flatten(), max_gap);
            (e.covered_s > 0.0).then(|| e.joules / e.covered_s)
        })
        .collect()
}

/// Builds the report of a run from its samples, the sensors' names and wrap ranges, and the idle
/// baseline (watts per sensor).
pub fn report(
    samples: &[Sample],
    names: &[String],
    wraps: &[Option<f64>],
    idle: &[Option<f64>],
    max_gap: f64,
    cpu: (Option<f64>, String),
    unavailable: Vec<Unavailable>,
) -> Report {
    let duration_s = match (samples.first(), samples.last()) {
        (Some(a), Some(b)) => b.t - a.t,
        _ => 0.0,
    };
    // Bytes moved in each interval.
    let moved: Vec<Option<u64>> = samples.windows(2).map(|w| Some(w[1].bytes?.saturating_sub(w[0].bytes?))).collect();
    let bytes = match (samples.first().and_then(|s| s.bytes), samples.last().and_then(|s| s.bytes)) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let active: Vec<bool> = moved.iter().map(|m| m.is_some_and(|b| b > 0)).collect();
    let io_active_s =
        bytes.map(|_| samples.windows(2).zip(&active).filter(|(_, &a)| a).map(|(w, _)| w[1].t - w[0].t).sum());
    let sensors = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let e = integrate(&traces(samples, i), wraps.get(i).copied().flatten(), max_gap);
            let idle_w = idle.get(i).copied().flatten();
            let above = idle_w.map(|w| e.joules - w * e.covered_s);
            let io = match (idle_w, bytes) {
                (Some(w), Some(_)) => Some(
                    e.intervals
                        .iter()
                        .zip(samples.windows(2))
                        .zip(&active)
                        .filter(|(_, &a)| a)
                        .filter_map(|((j, w2), _)| j.map(|j| j - w * (w2[1].t - w2[0].t)))
                        .sum::<f64>(),
                ),
                _ => None,
            };
            let j_per_gb = match (io, bytes) {
                (Some(j), Some(b)) if b > 0 => Some(j / (b as f64 / 1e9)),
                _ => None,
            };
            SensorReport {
                sensor: name.clone(),
                total_j: e.joules,
                idle_w,
                above_idle_j: above,
                io_above_idle_j: io,
                j_per_gb,
                covered_s: e.covered_s,
                missed_samples: e.missed,
                wraps: e.wraps,
                lost: e.lost,
            }
        })
        .collect();
    Report { duration_s, io_active_s, bytes, cpu_seconds: cpu.0, cpu_source: cpu.1, sensors, unavailable }
}

/// Cumulative bytes of the measured stage, read at every sample.
pub type ByteCounter = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The sensors back, and every sample taken.
pub type Recording = (Vec<Box<dyn Sensor>>, Vec<Sample>);

/// A background sampler.
pub struct Monitor {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Recording>>,
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Monitor {
    /// Samples `sensors` (and `bytes`) every `interval` on a thread until [`Monitor::stop`]; each sample
    /// is also written to `log` as a JSON line.
    pub fn start(
        mut sensors: Vec<Box<dyn Sensor>>,
        interval: Duration,
        bytes: Option<ByteCounter>,
        mut log: Option<Box<dyn Write + Send>>,
    ) -> Monitor {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("energy-monitor".into())
            .spawn(move || {
                let started = Instant::now();
                let mut samples = Vec::new();
                let mut next = started;
                loop {
                    let sample = Sample {
                        t: started.elapsed().as_secs_f64(),
                        wall_ms: wall_ms(),
                        readings: sensors.iter_mut().map(|s| s.read().ok()).collect(),
                        bytes: bytes.as_ref().map(|b| b()),
                    };
                    if let Some(log) = &mut log {
                        let _ = serde_json::to_writer(&mut *log, &sample);
                        let _ = log.write_all(b"\n");
                        let _ = log.flush();
                    }
                    samples.push(sample);
                    if flag.load(Ordering::Relaxed) {
                        return (sensors, samples);
                    }
                    // Missed ticks are skipped, not bunched: the timestamps say what happened.
                    next += interval;
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    } else {
                        next = now;
                    }
                }
            })
            .expect("spawn the energy monitor");
        Monitor { stop, thread: Some(thread) }
    }

    /// Takes a last sample and returns the sensors and every sample.
    pub fn stop(mut self) -> Recording {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().expect("running").join().expect("energy monitor thread")
    }
}

/// Runs a monitor for `duration` with nothing else asked of the machine: the idle baseline.
pub fn measure_idle(
    sensors: Vec<Box<dyn Sensor>>,
    duration: Duration,
    interval: Duration,
) -> (Vec<Box<dyn Sensor>>, Vec<Sample>) {
    let m = Monitor::start(sensors, interval, None, None);
    std::thread::sleep(duration);
    m.stop()
}

/// `--energy-log FILE` of a long-running process: the timeline as JSON lines (one [`Sample`] per
/// interval, with the process's byte counter), then a `{"summary": Report}` line when it ends (no idle
/// baseline: a server or mount cannot stop its own work to measure idle; `batchfs-lab energy` can).
pub struct EnergyLog {
    monitor: Monitor,
    path: PathBuf,
    names: Vec<String>,
    wraps: Vec<Option<f64>>,
    unavailable: Vec<Unavailable>,
}

/// Sensors detected and the log file created, ready to start with the process's byte counter (detection
/// takes [`PROBE`], so do it before the work begins).
pub struct PreparedLog {
    sensors: Vec<Box<dyn Sensor>>,
    unavailable: Vec<Unavailable>,
    file: std::fs::File,
    path: PathBuf,
}

impl PreparedLog {
    /// Starts sampling every `interval`.
    pub fn start(self, interval: Duration, bytes: ByteCounter) -> EnergyLog {
        let names = self.sensors.iter().map(|s| s.name().to_owned()).collect();
        let wraps = self.sensors.iter().map(|s| s.wrap_joules()).collect();
        let log: Box<dyn Write + Send> = Box::new(std::io::BufWriter::new(self.file));
        let monitor = Monitor::start(self.sensors, interval, Some(bytes), Some(log));
        EnergyLog { monitor, path: self.path, names, wraps, unavailable: self.unavailable }
    }
}

impl EnergyLog {
    /// Detects the sensors and creates the log file at `path`.
    pub fn prepare(path: &Path) -> std::io::Result<PreparedLog> {
        let (sensors, unavailable) = detect(Path::new("/"), true, PROBE);
        for u in &unavailable {
            tracing::info!(sensor = %u.sensor, reason = %u.reason, "energy sensor unavailable");
        }
        Ok(PreparedLog { sensors, unavailable, file: std::fs::File::create(path)?, path: path.to_owned() })
    }

    /// Stops sampling and appends the summary line; returns the report.
    pub fn finish(self, max_gap: f64) -> std::io::Result<Report> {
        let (_, samples) = self.monitor.stop();
        let idle = vec![None; self.names.len()];
        let r =
            report(&samples, &self.names, &self.wraps, &idle, max_gap, (None, "not measured".into()), self.unavailable);
        let mut file = std::fs::OpenOptions::new().append(true).open(&self.path)?;
        serde_json::to_writer(&mut file, &serde_json::json!({ "summary": &r }))?;
        file.write_all(b"\n")?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    fn energy(points: &[(f64, Option<f64>)]) -> Vec<(f64, Option<Reading>)> {
        points.iter().map(|&(t, v)| (t, v.map(Reading::Energy))).collect()
    }

    #[test]
    fn steady_counter() {
        // 50 W for 2 s, sampled every 100 ms.
        let trace = energy(&(0..=20).map(|i| (i as f64 * 0.1, Some(1000.0 + 5.0 * i as f64))).collect::<Vec<_>>());
        let e = integrate(&trace, None, 0.35);
        assert!(close(e.joules, 100.0) && close(e.covered_s, 2.0), "{e:?}");
        assert!(e.intervals.iter().all(|j| j.is_some_and(|j| close(j, 5.0))));
    }

    #[test]
    fn wrap_around_is_added_back() {
        // powercap-style counter wrapping at 262.143 J.
        let range = 262.143;
        let trace = energy(&[(0.0, Some(250.0)), (0.1, Some(260.0)), (0.2, Some(8.0)), (0.3, Some(18.0))]);
        let e = integrate(&trace, Some(range), 0.35);
        assert!(close(e.joules, 10.0 + (8.0 + range - 260.0) + 10.0), "{e:?}");
        assert_eq!(e.wraps, 1);
        // Without a known range a drop is a reset: that interval is not counted.
        let e = integrate(&trace, None, 0.35);
        assert!(close(e.joules, 20.0) && close(e.covered_s, 0.2));
    }

    #[test]
    fn missing_samples_of_a_counter_lose_nothing() {
        let trace = energy(&[(0.0, Some(0.0)), (0.1, None), (0.2, None), (0.3, Some(30.0)), (0.4, Some(40.0))]);
        let e = integrate(&trace, None, 0.35);
        assert!(close(e.joules, 40.0) && close(e.covered_s, 0.4));
        assert_eq!(e.missed, 2);
        // The 30 J across the gap are spread over its three intervals by time.
        assert!(e.intervals[..3].iter().all(|j| j.is_some_and(|j| close(j, 10.0))), "{:?}", e.intervals);
    }

    #[test]
    fn power_samples_integrate_by_trapezoids_not_across_long_gaps() {
        let p = |t, w: Option<f64>| (t, w.map(Reading::Power));
        let trace =
            vec![p(0.0, Some(100.0)), p(0.1, Some(200.0)), p(0.2, None), p(0.6, Some(100.0)), p(0.7, Some(100.0))];
        let e = integrate(&trace, None, 0.35);
        // 0.0-0.1: 15 J; 0.1-0.6 is a 0.5 s gap (> 0.35): not integrated; 0.6-0.7: 10 J.
        assert!(close(e.joules, 25.0) && close(e.covered_s, 0.2), "{e:?}");
    }

    #[test]
    fn a_sensor_that_disappears_is_flagged() {
        let trace = energy(&[(0.0, Some(0.0)), (0.1, Some(3.0)), (0.2, None), (0.3, None)]);
        let e = integrate(&trace, None, 0.35);
        assert!(close(e.joules, 3.0) && e.lost && e.missed == 2);
        let never = integrate(&energy(&[(0.0, None), (0.1, None)]), None, 0.35);
        assert!(never.joules == 0.0 && !never.lost && never.covered_s == 0.0);
    }

    #[test]
    fn idle_baseline_and_io_attribution() {
        // Idle: 20 W. Run: 2 s at 50 W; the I/O stage moves 1 GB during the first second only.
        let idle: Vec<Sample> = (0..=10)
            .map(|i| Sample {
                t: i as f64 * 0.1,
                wall_ms: 0,
                readings: vec![Some(Reading::Energy(2.0 * i as f64))],
                bytes: None,
            })
            .collect();
        let idle_w = idle_watts(&idle, 1, 0.35, &[None]);
        assert!(close(idle_w[0].unwrap(), 20.0));
        let run: Vec<Sample> = (0..=20)
            .map(|i| Sample {
                t: i as f64 * 0.1,
                wall_ms: 0,
                readings: vec![Some(Reading::Energy(5.0 * i as f64))],
                bytes: Some(100_000_000 * i.min(10) as u64),
            })
            .collect();
        let r = report(&run, &["cpu".into()], &[None], &idle_w, 0.35, (Some(1.5), "task-clock".into()), vec![]);
        let s = &r.sensors[0];
        assert!(close(s.total_j, 100.0));
        assert!(close(s.above_idle_j.unwrap(), 100.0 - 40.0));
        assert!(close(r.io_active_s.unwrap(), 1.0));
        assert!(close(s.io_above_idle_j.unwrap(), 50.0 - 20.0));
        assert!(close(s.j_per_gb.unwrap(), 30.0));
        assert_eq!(r.bytes, Some(1_000_000_000));
    }

    #[test]
    fn absent_sensors_are_reported_with_reasons() {
        let empty = tempfile::tempdir().unwrap();
        let (sensors, missing) = detect(empty.path(), false, Duration::ZERO);
        assert!(sensors.is_empty());
        let text = format!("{missing:?}");
        assert!(text.contains("no power PMU") && text.contains("powercap"), "{text}");
        // The GPU is always accounted for: a sensor per GPU, or the reason there is none.
        let (sensors, missing) = detect(empty.path(), true, Duration::ZERO);
        let gpus = sensors.iter().filter(|s| s.name().starts_with("gpu-")).count();
        let why = missing.iter().find(|u| u.sensor.starts_with("gpu"));
        assert!(gpus > 0 || why.is_some_and(|u| u.reason.contains("NVML")), "{missing:?}");
    }

    #[test]
    fn powercap_sensors_read_sysfs_with_wraparound() {
        let root = tempfile::tempdir().unwrap();
        let zone = root.path().join("sys/class/powercap/intel-rapl:0");
        std::fs::create_dir_all(&zone).unwrap();
        std::fs::write(zone.join("name"), "package-0\n").unwrap();
        std::fs::write(zone.join("energy_uj"), "262000000\n").unwrap();
        std::fs::write(zone.join("max_energy_range_uj"), "262143328850\n").unwrap();
        let (sensors, missing) = detect(root.path(), false, Duration::from_millis(20));
        assert!(sensors.is_empty(), "a counter that does not advance is not trusted");
        assert!(format!("{missing:?}").contains("did not advance"));
        let (mut sensors, _) = detect(root.path(), false, Duration::ZERO);
        assert_eq!(sensors.len(), 1);
        assert_eq!(sensors[0].name(), "powercap-package-0-intel-rapl:0");
        assert_eq!(sensors[0].read().unwrap(), Reading::Energy(262.0));
        assert!(close(sensors[0].wrap_joules().unwrap(), 262143.32885));
        std::fs::remove_file(zone.join("energy_uj")).unwrap();
        let gone = sensors[0].read().unwrap_err();
        assert!(matches!(gone, ReadError::File { .. }), "a sensor that disappears reads as an error: {gone}");
    }

    #[test]
    fn monitor_samples_on_a_thread_and_logs_jsonl() {
        struct Fake(f64);
        impl Sensor for Fake {
            fn name(&self) -> &str {
                "fake"
            }
            fn read(&mut self) -> Result<Reading, ReadError> {
                self.0 += 1.0;
                Ok(Reading::Energy(self.0))
            }
        }
        let log = tempfile::NamedTempFile::new().unwrap();
        let file = log.reopen().unwrap();
        let m = Monitor::start(
            vec![Box::new(Fake(0.0))],
            Duration::from_millis(10),
            Some(Arc::new(|| 7)),
            Some(Box::new(file)),
        );
        std::thread::sleep(Duration::from_millis(100));
        let (_, samples) = m.stop();
        assert!(samples.len() >= 5, "{}", samples.len());
        assert!(samples.windows(2).all(|w| w[1].t > w[0].t));
        let lines = std::fs::read_to_string(log.path()).unwrap();
        assert_eq!(lines.lines().count(), samples.len());
        let first: Sample = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
        assert_eq!(first.bytes, Some(7));
    }
}
