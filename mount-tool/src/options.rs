//! Mount options: every one works as `-o key=value` (fstab style) and as a long flag. Defaults are
//! documented in `docs/CONFIGURATION.md`.

pub use crate::fs::RollingMode;
use batchfs::api::BatchQuery;
use batchfs::encode::BatchFormat;
use batchfs::plan::PlanOptions;
use batchfs::units::{parse_duration, parse_size};
use std::path::PathBuf;
use std::time::Duration;

/// Everything a mount is configured with.
#[derive(Debug, Clone, PartialEq)]
pub struct MountOptions {
    pub plan: PlanOptions,
    /// `tfrecord` or `tar`.
    pub format: BatchFormat,
    /// Epoch directories listed.
    pub epochs: u64,
    /// The epoch the first open of each `rolling/` file serves (a job restarted mid-run sets it).
    pub first_epoch: u64,
    /// How `rolling/` lays out TFRecord batches.
    pub rolling: RollingMode,
    /// Batches kept in flight ahead of each reader (0: none).
    pub prefetch: usize,
    /// The window ahead of each reader holds at least this many bytes of batches.
    pub prefetch_bytes: u64,
    /// Bytes of prefetches in flight at once, all readers together.
    pub max_prefetch_bytes: u64,
    /// Cache byte budget.
    pub cache: u64,
    /// HTTP/2 connections per server.
    pub connections: usize,
    /// How long reads wait out an unreachable server before EIO.
    pub timeout: Duration,
    /// A response with no bytes for this long is abandoned and retried.
    pub stall_timeout: Duration,
    pub token_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    pub allow_other: bool,
    pub auto_unmount: bool,
    /// More servers holding the same dataset (base URLs).
    pub servers: Vec<String>,
    /// FUSE worker threads.
    pub threads: usize,
    /// Hand verified files to the kernel (FUSE passthrough) where it allows.
    pub passthrough: bool,
    /// Drop a file's kernel page cache at its last close when it was read through the daemon.
    pub drop_page_cache: bool,
    /// A cached batch unread for this long may make room for prefetches.
    pub stale_after: Duration,
    /// Kernel readahead of the mount in KiB (set when running as root; 0 leaves the default).
    pub read_ahead_kb: u32,
    /// Where a daemonized mount logs (nothing when absent).
    pub log_file: Option<PathBuf>,
    /// Energy timeline with the bytes served, as JSON lines (docs/ENERGY.md).
    pub energy_log: Option<PathBuf>,
    /// Serve the counters for Prometheus at `GET /metrics` on this address.
    pub metrics: Option<std::net::SocketAddr>,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            plan: PlanOptions::default(),
            format: BatchFormat::Tfrecord,
            epochs: 100,
            first_epoch: 0,
            rolling: RollingMode::Auto,
            prefetch: 16,
            prefetch_bytes: 128 << 20,
            max_prefetch_bytes: 256 << 20,
            cache: 2 << 30,
            connections: 4,
            timeout: Duration::from_secs(60),
            stall_timeout: Duration::from_secs(10),
            token_file: None,
            ca_file: None,
            allow_other: false,
            auto_unmount: false,
            servers: Vec::new(),
            threads: 16,
            passthrough: true,
            drop_page_cache: true,
            stale_after: Duration::from_secs(10),
            read_ahead_kb: 1024,
            log_file: None,
            energy_log: None,
            metrics: None,
        }
    }
}

/// Options mount(8) passes that mean nothing to batchfs.
const IGNORED: &[&str] = &[
    "_netdev", "defaults", "auto", "noauto", "user", "users", "nouser", "owner", "nofail", "ro", "rw", "exec",
    "noexec", "suid", "nosuid", "dev", "nodev", "atime", "noatime", "relatime", "async", "sync",
];

fn boolean(key: &str, value: Option<&str>) -> Result<bool, String> {
    match value {
        None | Some("true") | Some("1") | Some("yes") => Ok(true),
        Some("false") | Some("0") | Some("no") => Ok(false),
        Some(v) => Err(format!("{key}={v}: expected true or false")),
    }
}

impl MountOptions {
    /// Applies one `key[=value]` option.
    pub fn set(&mut self, key: &str, value: Option<&str>) -> Result<(), String> {
        let need = || value.ok_or_else(|| format!("option {key} needs a value ({key}=...)"));
        let number = |v: &str| v.parse::<u64>().map_err(|_| format!("{key}={v}: expected a number"));
        match key {
            // The plan options and the format: parsed as the server parses them in a query.
            "batch_size" | "seed" | "shuffle" | "drop_last" | "format" => {
                let mut query = self.query();
                query.set(key, value).map_err(|e| e.to_string())?;
                if !matches!(query.format, BatchFormat::Tfrecord | BatchFormat::Tar) {
                    return Err(format!("format={}: a mount shows tfrecord (with .idx twins) or tar", query.format));
                }
                (self.plan, self.format) = (query.plan, query.format);
            }
            "epochs" => self.epochs = number(need()?)?,
            "first_epoch" => {
                let e = number(need()?)?;
                if e > batchfs::plan::MAX_EPOCH {
                    return Err(format!("first_epoch={e}: epochs go up to {}", batchfs::plan::MAX_EPOCH));
                }
                self.first_epoch = e;
            }
            "rolling" => {
                self.rolling = match need()? {
                    "auto" => RollingMode::Auto,
                    // `slots` was the padded layout the indexed one replaced, for the same readers.
                    "indexed" | "slots" => RollingMode::Indexed,
                    "packed" => RollingMode::Packed,
                    v => return Err(format!("rolling={v}: expected auto, indexed or packed")),
                }
            }
            "prefetch" => self.prefetch = number(need()?)? as usize,
            "prefetch_bytes" => self.prefetch_bytes = parse_size(need()?)?,
            "max_prefetch_bytes" => self.max_prefetch_bytes = parse_size(need()?)?.max(1),
            "cache" => self.cache = parse_size(need()?)?,
            "connections" => self.connections = (number(need()?)? as usize).max(1),
            "timeout" => self.timeout = parse_duration(need()?)?,
            "stall_timeout" => self.stall_timeout = parse_duration(need()?)?,
            "token_file" => self.token_file = Some(need()?.into()),
            "ca_file" => self.ca_file = Some(need()?.into()),
            "allow_other" => self.allow_other = boolean(key, value)?,
            "auto_unmount" => self.auto_unmount = boolean(key, value)?,
            "servers" => self
                .servers
                .extend(need()?.split(';').filter(|s| !s.is_empty()).map(|s| s.trim_end_matches('/').to_owned())),
            "threads" => self.threads = (number(need()?)? as usize).max(1),
            "read_ahead_kb" => {
                self.read_ahead_kb = u32::try_from(number(need()?)?).map_err(|_| format!("{key} too large"))?
            }
            "passthrough" => self.passthrough = boolean(key, value)?,
            "metrics" => {
                let v = need()?;
                self.metrics =
                    Some(v.parse().map_err(|_| format!("metrics={v}: expected ADDR:PORT, e.g. 127.0.0.1:9187"))?)
            }
            "page_cache" => {
                self.drop_page_cache = match need()? {
                    "drop" => true,
                    "keep" => false,
                    v => return Err(format!("page_cache={v}: expected drop or keep")),
                }
            }
            "stale_after" => self.stale_after = parse_duration(need()?)?,
            "log_file" => self.log_file = Some(need()?.into()),
            "energy_log" => self.energy_log = Some(need()?.into()),
            k if IGNORED.contains(&k) || k.starts_with("x-") || k.starts_with("comment=") => {}
            other => return Err(format!("unknown mount option {other:?} (see docs/CONFIGURATION.md)")),
        }
        Ok(())
    }

    /// Applies a comma-separated `-o` list.
    pub fn apply_list(&mut self, list: &str) -> Result<(), String> {
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            self.set(key, value)?;
        }
        Ok(())
    }

    /// The query the client sends.
    pub fn query(&self) -> BatchQuery {
        BatchQuery { plan: self.plan, format: self.format }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfs::plan::Shuffle;

    #[test]
    fn the_deployment_mount_options_parse() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
        let read = |f: &str| std::fs::read_to_string(format!("{root}/{f}")).unwrap();
        let unit = read("systemd/mnt-imagenet.mount");
        let fstab = read("systemd/fstab.example");
        let daemonset = read("k8s/mount-daemonset.yaml");
        let lists = [
            unit.lines().find_map(|l| l.strip_prefix("Options=")).unwrap().to_owned(),
            fstab.lines().find(|l| !l.starts_with('#')).unwrap().split_whitespace().nth(3).unwrap().to_owned(),
            daemonset.split("\"-o\", \"").nth(1).unwrap().split('"').next().unwrap().to_owned(),
        ];
        for list in lists {
            let mut o = MountOptions::default();
            o.apply_list(&list).unwrap_or_else(|e| panic!("{list}: {e}"));
            assert_eq!((o.plan.batch_size, o.epochs), (256, 90), "{list}");
        }
    }

    #[test]
    fn fstab_style_lists() {
        let mut o = MountOptions::default();
        let list = "_netdev,batch_size=64,prefetch=8,cache=512M,shuffle=none,drop_last,format=tar,timeout=5s,\
                    servers=http://a:1;http://b:2/,allow_other,x-systemd.automount";
        o.apply_list(list).unwrap();
        assert_eq!(o.plan.batch_size, 64);
        assert_eq!(o.prefetch, 8);
        assert_eq!(o.cache, 512 << 20);
        assert_eq!(o.prefetch_bytes, 128 << 20, "the default");
        o.apply_list("prefetch_bytes=0").unwrap();
        assert_eq!(o.prefetch_bytes, 0);
        assert_eq!(o.plan.shuffle, Shuffle::None);
        assert!(o.plan.drop_last && o.allow_other);
        assert_eq!(o.format, BatchFormat::Tar);
        assert_eq!(o.timeout, Duration::from_secs(5));
        assert_eq!(o.servers, ["http://a:1", "http://b:2"]);
        assert!(o.drop_page_cache, "dropped by default");
        o.apply_list("page_cache=keep").unwrap();
        assert!(!o.drop_page_cache);
        assert_eq!((o.first_epoch, o.rolling, o.epochs), (0, RollingMode::Auto, 100));
        o.apply_list("first_epoch=7,rolling=packed").unwrap();
        assert_eq!((o.first_epoch, o.rolling), (7, RollingMode::Packed));
        o.apply_list("rolling=slots").unwrap();
        assert_eq!(o.rolling, RollingMode::Indexed, "the former name");
        let bad = [
            "batch_size=0",
            "cache=lots",
            "format=zip",
            "format=tfrecord.slots",
            "colour=red",
            "seed",
            "drop_last=maybe",
            "page_cache=x",
            "rolling=sideways",
            "first_epoch=1000000",
        ];
        for bad in bad {
            assert!(MountOptions::default().apply_list(bad).is_err(), "{bad}");
        }
    }
}
