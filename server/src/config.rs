//! Server configuration: limits with safe defaults, and the TOML config file (an alternative to the
//! command line; flags given on the command line override the file).
//!
//! Every limit is declared once, in the `limits!` list below: its type, how its value is written (a
//! count, a size such as `16M`, or a duration such as `30s`), its default and its help. From that one list
//! come [`ServerLimits`], the `[limits]` table of the config file ([`LimitsFile`]) and the
//! `--limit-name VALUE` flags ([`LimitArgs`]), all three parsed by the same functions.
//!
//! A value that does not parse (a limit's, or a `--dataset NAME=PATH`) is a [`ValueError`]; limits that
//! cannot be used are a [`LimitError`]: a `[limits]` value of the file, named (`limits.NAME: ...`), or a
//! value hyper or the protocol would refuse.

use crate::policy::PolicyError;
use batchfs::index::SourceFormat;
use batchfs::units::{parse_duration, parse_size};
use serde::Deserialize;
use std::num::ParseIntError;
use std::path::PathBuf;
use std::time::Duration;

/// Why a value, on the command line or in the config file, does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("{text:?} is not a number in range")]
    NotACount { text: String, source: ParseIntError },
    /// A size, duration or switch that does not parse (`batchfs::units`, the parsers every side uses).
    #[error(transparent)]
    Unit(#[from] batchfs::units::UnitError),
    #[error("{text:?} is too large")]
    TooLarge { text: String },
    /// An `io`, `resident`, `disk_cache` or `disk_cache_size` value.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("{text:?}: expected NAME=PATH")]
    NotADatasetSpec { text: String },
    #[error("{text:?}: expected NAME=PATH with both parts non-empty")]
    EmptyDatasetSpec { text: String },
    /// A URL of a store other than S3's (`gs://`, `az://`, `https://`): it was looked for as a directory.
    #[error("{path}: only s3:// object stores are supported (a dataset is a directory or s3://BUCKET/PREFIX)")]
    UnsupportedStore { path: String },
    #[error(
        "dataset name {name:?} must be non-empty, not `.` or `..`, without '/', '?', '#', '%' or control characters"
    )]
    DatasetName { name: String },
}

/// Why the limits cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// A `[limits]` value of the config file.
    #[error("limits.{name}: {source}")]
    Value { name: &'static str, source: ValueError },
    #[error("max_frame_size must be between 16K and 16M-1, got {got}")]
    FrameSize { got: u32 },
    #[error("HTTP/2 windows must be below 2 GiB")]
    WindowTooLarge,
    /// A limit below which the server cannot serve (every request refused, or none read).
    #[error("{name} must be at least {min}, got {got}")]
    TooSmall { name: &'static str, min: u64, got: u64 },
    /// A limit that means nothing without another (it was taken without a word).
    #[error("{name} is set but {needs} is not: {name} has no effect without it")]
    Needs { name: &'static str, needs: &'static str },
}

/// How a limit's value is written, on the command line and in the config file.
mod value {
    use super::*;

    /// A plain number: `256`.
    pub fn count<T: std::str::FromStr<Err = ParseIntError>>(text: &str) -> Result<T, ValueError> {
        text.trim().parse().map_err(|source| ValueError::NotACount { text: text.to_owned(), source })
    }

    /// A size: `1048576`, `1M`, `16K`.
    pub fn size<T: TryFrom<u64>>(text: &str) -> Result<T, ValueError> {
        let bytes = parse_size(text)?;
        T::try_from(bytes).map_err(|_| ValueError::TooLarge { text: text.to_owned() })
    }

    /// A duration: `30s`, `5m`, `250ms`.
    pub fn duration(text: &str) -> Result<Duration, ValueError> {
        Ok(parse_duration(text)?)
    }

    /// On or off: `on`, `off` (or `true`, `false`, `yes`, `no`, `1`, `0`: the mount's spellings too).
    pub fn switch(text: &str) -> Result<bool, ValueError> {
        Ok(batchfs::units::parse_switch(text)?)
    }
}

/// A `[limits]` value in the config file: a TOML integer, float, boolean or string (`"16M"`, `"30s"`),
/// parsed from its text by the limit's own parser, so that a wrong one (`-1`, `1.5` for a count) is
/// refused naming the limit and what it takes, not as a TOML type that matches no variant.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum LimitValue {
    Integer(i64),
    Float(f64),
    Switch(bool),
    Text(String),
}

impl LimitValue {
    fn text(&self) -> String {
        match self {
            LimitValue::Integer(n) => n.to_string(),
            LimitValue::Float(x) => x.to_string(),
            LimitValue::Switch(b) => b.to_string(),
            LimitValue::Text(s) => s.clone(),
        }
    }
}

/// Declares the server's limits once; see the module note for what it generates.
macro_rules! limits {
    ($(
        $name:ident: $ty:ty = $default:expr, $parse:expr, $shown:literal, $placeholder:literal, $help:literal;
    )+) => {
        /// Every limit of the server. Defaults are documented in `docs/CONFIGURATION.md`.
        #[derive(Debug, Clone, PartialEq)]
        pub struct ServerLimits {
            $( #[doc = $help] pub $name: $ty, )+
        }

        impl Default for ServerLimits {
            fn default() -> Self {
                ServerLimits { $( $name: $default, )+ }
            }
        }

        /// `[limits]` of the config file: sizes as `"16M"` or integers, durations as `"30s"`.
        #[derive(Debug, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct LimitsFile {
            $( #[doc = $help] pub $name: Option<LimitValue>, )+
        }

        impl LimitsFile {
            /// Applies the values present to `limits`.
            pub fn apply(&self, limits: &mut ServerLimits) -> Result<(), LimitError> {
                $(
                    if let Some(v) = &self.$name {
                        let parse: fn(&str) -> Result<$ty, _> = $parse;
                        limits.$name = parse(&v.text())
                            .map_err(|e| LimitError::Value { name: stringify!($name), source: ValueError::from(e) })?;
                    }
                )+
                Ok(())
            }
        }

        /// Limits as flags; each overrides the config file's `[limits]` value and the default.
        #[derive(Debug, Default, clap::Args)]
        pub struct LimitArgs {
            $(
                #[arg(long, value_name = $placeholder, value_parser = $parse as fn(&str) -> Result<$ty, _>,
                      help = concat!($help, " [default: ", $shown, "]"), help_heading = "Limits")]
                pub $name: Option<$ty>,
            )+
        }

        impl LimitArgs {
            /// Applies the flags given to `limits`.
            pub fn apply(&self, limits: &mut ServerLimits) {
                $( if let Some(v) = &self.$name { limits.$name = v.clone(); } )+
            }
        }

        /// Each limit's name, its default as written in the help and the docs, and its parser's verdict
        /// on that text (for the test that keeps help, docs and defaults in step).
        #[cfg(test)]
        fn documented_defaults() -> Vec<(&'static str, &'static str, bool)> {
            let defaults = ServerLimits::default();
            vec![$(
                (stringify!($name), $shown, {
                    let parse: fn(&str) -> Result<$ty, _> = $parse;
                    parse($shown).map(|v| v == defaults.$name).unwrap_or(false)
                }),
            )+]
        }
    };
}

limits! {
    max_concurrent_streams: u32 = 256, value::count, "256", "N",
        "HTTP/2 streams per connection.";
    max_header_bytes: u32 = 16 << 10, value::size, "16K", "SIZE",
        "Largest request header block (HTTP/2 header list, HTTP/1 buffer).";
    max_pending_accept_reset_streams: usize = 20, value::count, "20", "N",
        "Streams reset by the client before the server accepted them, per connection (rapid reset, \
         CVE-2023-44487): past this the connection is closed.";
    max_local_error_reset_streams: usize = 1024, value::count, "1024", "N",
        "Streams the server may reset because of client errors, per connection.";
    stream_window: u32 = 16 << 20, value::size, "16M", "SIZE",
        "HTTP/2 per-stream receive window the server advertises.";
    connection_window: u32 = 64 << 20, value::size, "64M", "SIZE",
        "HTTP/2 connection receive window.";
    max_frame_size: u32 = 1 << 20, value::size, "1M", "SIZE",
        "Largest HTTP/2 frame the server accepts.";
    max_send_buf_size: usize = 4 << 20, value::size, "4M", "SIZE",
        "Bytes buffered per stream for sending.";
    unsent_bytes: u32 = 512 << 10, value::size, "512K", "SIZE",
        "Bytes a connection's socket holds unsent (TCP_NOTSENT_LOWAT; 0: the kernel's default, no bound).";
    keep_alive_interval: Duration = Duration::from_secs(20), value::duration, "20s", "DURATION",
        "HTTP/2 ping interval on idle connections (dead peers are detected).";
    keep_alive_timeout: Duration = Duration::from_secs(20), value::duration, "20s", "DURATION",
        "How long a ping may go unanswered.";
    header_read_timeout: Duration = Duration::from_secs(30), value::duration, "30s", "DURATION",
        "Time allowed for an HTTP/1 request head or a TLS handshake.";
    idle_timeout: Duration = Duration::from_secs(300), value::duration, "5m", "DURATION",
        "A connection with no bytes moving for this long is closed.";
    request_timeout: Duration = Duration::from_secs(60), value::duration, "60s", "DURATION",
        "Time allowed to produce a response head.";
    drain_timeout: Duration = Duration::from_secs(30), value::duration, "30s", "DURATION",
        "On shutdown, time allowed for in-flight responses to finish.";
    max_connections: usize = 4096, value::count, "4096", "N",
        "Open connections at once; more wait in the listen backlog.";
    storage_concurrency: usize = 16, value::count, "16", "N",
        "Concurrent blocking storage reads (page faults, warming), server-wide.";
    readahead_batches: u64 = 4, value::count, "4", "N",
        "Batches of the same plan warmed ahead of each batch request (0 disables; not with io=direct).";
    io: crate::policy::IoMode = crate::policy::IoMode::Auto, crate::policy::IoMode::parse, "auto", "MODE",
        "How shards are read: mmap (shared mappings), direct (positioned reads with O_DIRECT into reused \
         aligned buffers, bypassing the page cache), pread (positioned reads through the page cache, pages \
         dropped after use when the data does not fit), or auto: mmap when the dataset fits in half the \
         server's memory (the machine's, or its memory cgroup's limit), else direct (pread where the \
         filesystem refuses O_DIRECT).";
    resident: crate::policy::Resident = crate::policy::Resident::Auto, crate::policy::Resident::parse,
        "auto", "SIZE",
        "With io=direct, whole shards up to this many bytes, over all datasets, are read once into the \
         server's own memory and served from it; the rest are read with direct reads. auto: half the memory \
         the server may use (the machine's, or its memory cgroup's limit); 0: none.";
    max_mapped_shards: usize = 4096, value::count, "4096", "N",
        "A dataset of more shards than this is read with positioned reads instead of mapped (a file tree of \
         many small files: one mapping per file would exceed the kernel's vm.max_map_count).";
    max_bodies_in_flight: u64 = 1024, value::count, "1024", "N",
        "Batch and file bodies and large JSON documents (manifests, slot tables, listing pages) being sent at \
         once, server-wide; past this a request is answered 503 with Retry-After at once (mounts back off or \
         move to another replica), which bounds the memory the bodies hold.";
    framing_memory: u64 = 512 << 20, value::size, "512M", "SIZE",
        "Memory the layouts of the bodies in flight may hold together, server-wide: a batch's framing (a tar \
         member's 512-byte header, a TFRecord frame's lengths and CRCs) and where each piece of its bytes is, \
         held from before its first byte is sent until its last (about 1 KB a tar member). A batch whose layout \
         is larger than a quarter of this is refused (400: ask for a smaller batch_size); one that meets the \
         others' is answered 503 with Retry-After.";
    sendfile: bool = false, value::switch, "off", "on|off",
        "Over h2c, body bytes of mapped shards are sent from their file with sendfile(2), not copied out \
         of the mapping: the socket takes the file's pages (TLS always encrypts a copy). Off by default: \
         over loopback it saved the server nothing and cost the receiver more (docs/BENCHMARKS.md).";
    chunk_size: u64 = 1 << 20, value::size, "1M", "SIZE",
        "Largest body chunk handed to HTTP at once.";
    read_depth: usize = 2, value::count, "2", "N",
        "Chunk reads each body keeps in flight ahead of what HTTP/2 has sent (reads from storage, not \
         views of pages already in memory).";
    object_requests: usize = 64, value::count, "64", "N",
        "Ranged GETs in flight to one bucket, server-wide (object datasets, s3://).";
    object_cache: u64 = 1 << 30, value::size, "1G", "SIZE",
        "Memory of the block cache of object datasets' checked reads, server-wide (at most an eighth of \
         the memory the server may use): mounts reading the same epoch read the bucket once.";
    object_gap: u64 = 64 << 10, value::size, "64K", "SIZE",
        "Ranges of one object at most this far apart are read with one GET (the bytes between are read \
         and dropped).";
    object_part: u64 = 8 << 20, value::size, "8M", "SIZE",
        "Largest ranged GET: indexing reads each object in parts of this size, several at once, and \
         merged reads stop growing here.";
    object_timeout: Duration = Duration::from_secs(30), value::duration, "30s", "DURATION",
        "Time allowed for one request to the object store (a stalled one is retried).";
    object_retry_for: Duration = Duration::from_secs(60), value::duration, "60s", "DURATION",
        "How long failed or throttled requests to the object store are retried at most, with backoff (the \
         S3 client's own retries of a request, at most 10, then the request again, while the time lasts), \
         before the read fails.";
    disk_cache: crate::policy::TierDir = crate::policy::TierDir(None), crate::policy::TierDir::parse, "none", "DIR",
        "A directory on the server's local disks where whole objects of s3:// datasets are kept (the disk \
         tier), checked, found again after a restart and evicted least recently used; what it holds is read \
         from there instead of the store, and objects are copied in in the order the plan reads them.";
    disk_cache_size: crate::policy::AutoSize = crate::policy::AutoSize::Auto, crate::policy::AutoSize::parse,
        "auto", "SIZE",
        "The most bytes of disk the disk tier takes, each copy counted as its size rounded up to the \
         filesystem's block. auto: 90 % of what its filesystem has free at start, plus what it already holds.";
    stage_objects: usize = 4, value::count, "4", "N",
        "Objects copied into the disk tier at once, each by ranged GETs of object_part, up to 8 in flight, \
         each body written as it arrives; the parts copied at once hold about a MiB each, at most an eighth \
         of the memory the server may use (512 MiB at most).";
    recheck_concurrency: usize = 2, value::count, "2", "N",
        "Rechecks of the disk tier's copies running at once: ranges of copies read again against the index \
         because a client found a body from them failing its checksum; one more asked for meanwhile is \
         refused (its body is served as it would be, and the client asks again on its next retry).";
}

/// One dataset to serve.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    pub name: String,
    pub path: PathBuf,
    /// Forces the source format (detected when absent).
    #[serde(default)]
    pub format: Option<SourceFormat>,
    /// Settings of an `s3://` dataset's store (`endpoint`, `region`, `access_key_id`, ...: the keys of
    /// `object_store`'s S3 builder), over the `AWS_*` environment. A value is a string, or a switch or
    /// number written bare (`allow_http = true`), taken as its text.
    #[serde(default, deserialize_with = "settings")]
    pub s3: std::collections::BTreeMap<String, String>,
    /// An `s3://` dataset's index is kept in its bucket too (`PREFIX/.batchfs-index`) and reused from
    /// there.
    #[serde(default)]
    pub index_in_bucket: bool,
}

/// An object store's settings by key, each value as text.
type StoreSettings = std::collections::BTreeMap<String, String>;

/// A table of store settings whose values are strings, switches or numbers: each as its text.
fn settings<'de, D: serde::Deserializer<'de>>(d: D) -> Result<StoreSettings, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Scalar {
        Text(String),
        Switch(bool),
        Integer(i64),
        Float(f64),
    }
    let table = std::collections::BTreeMap::<String, Scalar>::deserialize(d)?;
    let text = |v| match v {
        Scalar::Text(s) => s,
        Scalar::Switch(b) => b.to_string(),
        Scalar::Integer(i) => i.to_string(),
        Scalar::Float(f) => f.to_string(),
    };
    Ok(table.into_iter().map(|(k, v)| (k, text(v))).collect())
}

/// A dataset's name, as a URL's path segment and the name of its index file take it: refused where it would
/// reach elsewhere (`../x` wrote the index outside `index_dir`) or be read as part of a URL.
pub fn check_dataset_name(name: &str) -> Result<(), ValueError> {
    let bad = name.is_empty() || name == "." || name == ".." || name.contains(['/', '?', '#', '%']);
    match bad || name.chars().any(char::is_control) {
        true => Err(ValueError::DatasetName { name: name.to_owned() }),
        false => Ok(()),
    }
}

/// A dataset's path: a directory, or `s3://BUCKET/PREFIX`; a URL of another scheme is refused as such.
pub fn check_dataset_path(path: &std::path::Path) -> Result<(), ValueError> {
    let text = path.to_string_lossy();
    let scheme = text.split_once("://").map(|(scheme, _)| scheme);
    let is_scheme = |s: &str| {
        s.starts_with(|c: char| c.is_ascii_alphabetic())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    };
    match scheme.is_some_and(is_scheme) && !crate::policy::is_object_url(path) {
        true => Err(ValueError::UnsupportedStore { path: text.into_owned() }),
        false => Ok(()),
    }
}

impl std::str::FromStr for DatasetSpec {
    type Err = ValueError;

    /// `NAME=PATH`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, path) = s.split_once('=').ok_or_else(|| ValueError::NotADatasetSpec { text: s.to_owned() })?;
        if name.is_empty() || path.is_empty() {
            return Err(ValueError::EmptyDatasetSpec { text: s.to_owned() });
        }
        check_dataset_name(name)?;
        let path = PathBuf::from(path);
        check_dataset_path(&path)?;
        Ok(DatasetSpec { name: name.to_owned(), path, format: None, s3: Default::default(), index_in_bucket: false })
    }
}

/// The TOML config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub listen: Option<String>,
    #[serde(default, rename = "dataset")]
    pub datasets: Vec<DatasetSpec>,
    pub index_dir: Option<PathBuf>,
    pub skip_corrupt: Option<bool>,
    pub verify_data_crc: Option<bool>,
    pub follow_links: Option<bool>,
    pub token_file: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    #[serde(default)]
    pub limits: LimitsFile,
}

impl ServerLimits {
    /// How these limits say datasets are read (`io`, `max_mapped_shards`, `resident`, `sendfile`), with the
    /// memory the server may use detected.
    pub fn io_policy(&self) -> crate::policy::IoPolicy {
        let policy = crate::policy::IoPolicy::new(self.io, self.max_mapped_shards, self.resident);
        crate::policy::IoPolicy { sendfile: self.sendfile, ..policy }
    }

    /// Rejects values hyper or the protocol would refuse.
    pub fn validate(&self) -> Result<(), LimitError> {
        if !(16_384..=16_777_215).contains(&self.max_frame_size) {
            return Err(LimitError::FrameSize { got: self.max_frame_size });
        }
        if self.stream_window > i32::MAX as u32 || self.connection_window > i32::MAX as u32 {
            return Err(LimitError::WindowTooLarge);
        }
        // Below these nothing is served: `max_bodies_in_flight=0` refused every batch (503), and
        // `max_header_bytes=0` every request. (`max_mapped_shards=0` is no such limit: no dataset mapped.)
        let secs = |d: Duration| d.as_secs().max(u64::from(d.subsec_nanos() > 0));
        let least = [
            ("max_connections", self.max_connections as u64, 1),
            ("max_concurrent_streams", u64::from(self.max_concurrent_streams), 1),
            ("storage_concurrency", self.storage_concurrency as u64, 1),
            ("max_header_bytes", u64::from(self.max_header_bytes), 1024),
            ("max_bodies_in_flight", self.max_bodies_in_flight, 1),
            ("framing_memory", self.framing_memory, 1 << 20),
            ("read_depth", self.read_depth as u64, 1),
            ("object_requests", self.object_requests as u64, 1),
            ("stage_objects", self.stage_objects as u64, 1),
            ("recheck_concurrency", self.recheck_concurrency as u64, 1),
            ("request_timeout (seconds)", secs(self.request_timeout), 1),
            ("header_read_timeout (seconds)", secs(self.header_read_timeout), 1),
            // 0 sent a response's head and never a byte of its body over HTTP/2.
            ("max_send_buf_size", self.max_send_buf_size as u64, 1),
            // 0 closed every connection after its first response; every request to the store timed out.
            ("idle_timeout (seconds)", secs(self.idle_timeout), 1),
            ("object_timeout (seconds)", secs(self.object_timeout), 1),
        ];
        if let Some((name, got, min)) = least.into_iter().find(|&(_, got, min)| got < min) {
            return Err(LimitError::TooSmall { name, min, got });
        }
        if self.disk_cache.0.is_none() && self.disk_cache_size != crate::policy::AutoSize::Auto {
            return Err(LimitError::Needs { name: "disk_cache_size", needs: "disk_cache" });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_file_parses_and_applies() {
        let text = r#"
            listen = "127.0.0.1:7878"
            index_dir = "/tmp/idx"
            [[dataset]]
            name = "imagenet"
            path = "/data/imagenet"
            format = "tfrecord"
            [[dataset]]
            name = "tree"
            path = "/data/tree"
            [limits]
            stream_window = "32M"
            max_concurrent_streams = 64
            idle_timeout = "90s"
            chunk_size = 262144
        "#;
        let file: ConfigFile = toml::from_str(text).unwrap();
        assert_eq!(file.datasets.len(), 2);
        assert_eq!(file.datasets[0].format, Some(SourceFormat::Tfrecord));
        let mut limits = ServerLimits::default();
        file.limits.apply(&mut limits).unwrap();
        assert_eq!(limits.stream_window, 32 << 20);
        assert_eq!(limits.max_concurrent_streams, 64);
        assert_eq!(limits.idle_timeout, Duration::from_secs(90));
        assert_eq!(limits.chunk_size, 262_144);
        assert!(toml::from_str::<ConfigFile>("bogus = 1").is_err());
    }

    #[test]
    fn the_documented_example_parses_with_its_object_dataset_settings() {
        let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CONFIGURATION.md")).unwrap();
        let example = docs.split("### Example config file").nth(1).unwrap();
        let toml_text = example.split("```toml").nth(1).unwrap().split("```").next().unwrap();
        let file: ConfigFile = toml::from_str(toml_text).unwrap();
        let s3 = file.datasets.iter().find(|d| d.path.starts_with("s3:")).expect("an s3:// dataset");
        assert_eq!(s3.s3.get("allow_http").map(String::as_str), Some("true"));
        assert!(s3.index_in_bucket);
        // Switches and numbers may be written bare; a table or list is no setting.
        let bare = "[[dataset]]\nname = \"d\"\npath = \"s3://b/p\"\ns3 = { allow_http = true, retries = 3 }\n";
        let bare: ConfigFile = toml::from_str(bare).unwrap();
        let s3 = &bare.datasets[0].s3;
        assert_eq!((s3["allow_http"].as_str(), s3["retries"].as_str()), ("true", "3"));
        assert!(toml::from_str::<ConfigFile>("[[dataset]]\nname = \"d\"\npath = \"p\"\ns3 = { a = [1] }\n").is_err());
        assert!(file.datasets.iter().filter(|d| !d.path.starts_with("s3:")).all(|d| d.s3.is_empty()));
        let mut limits = ServerLimits::default();
        file.limits.apply(&mut limits).unwrap();
    }

    #[test]
    fn each_limit_has_one_default_shown_in_help_and_docs() {
        let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CONFIGURATION.md")).unwrap();
        for (name, shown, parses_to_default) in documented_defaults() {
            assert!(parses_to_default, "{name}: the default shown, {shown:?}, is not the default value");
            let row = format!("| `{name}` | {shown} |");
            assert!(docs.contains(&row), "docs/CONFIGURATION.md lacks the row {row:?}");
        }
    }

    #[test]
    fn flags_and_the_file_parse_limits_alike() {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Flags {
            #[command(flatten)]
            limits: LimitArgs,
        }
        let parse_flags = |args: &[&str]| Flags::try_parse_from(std::iter::once("x").chain(args.iter().copied()));
        let parse_file = |text: &str| -> Result<ServerLimits, String> {
            let file: LimitsFile = toml::from_str(text).map_err(|e| e.to_string())?;
            let mut limits = ServerLimits::default();
            file.apply(&mut limits).map_err(|e| e.to_string())?;
            Ok(limits)
        };
        let mut from_flags = ServerLimits::default();
        parse_flags(&[
            "--stream-window",
            "32M",
            "--idle-timeout",
            "90s",
            "--max-connections",
            "7",
            "--disk-cache",
            "/t",
        ])
        .unwrap()
        .limits
        .apply(&mut from_flags);
        let from_file =
            parse_file("stream_window = \"32M\"\nidle_timeout = \"90s\"\nmax_connections = 7\ndisk_cache = \"/t\"")
                .unwrap();
        assert_eq!(from_flags, from_file);
        assert_eq!(from_file.stream_window, 32 << 20);
        // A size as a TOML integer, a count as a string: both read as written.
        let l = parse_file("chunk_size = 262144\nmax_connections = \"9\"").unwrap();
        assert_eq!((l.chunk_size, l.max_connections), (262_144, 9));
        // The same errors on both sides.
        assert!(parse_flags(&["--stream-window", "5G"]).unwrap_err().to_string().contains("too large"));
        assert!(parse_file("stream_window = \"5G\"").unwrap_err().contains("too large"));
        assert!(parse_flags(&["--idle-timeout", "5q"]).is_err());
        assert!(parse_file("idle_timeout = \"5q\"").unwrap_err().starts_with("limits.idle_timeout"));
        assert!(parse_flags(&["--max-connections", "many"]).is_err());
        assert!(parse_file("max_connections = \"many\"").is_err());
        assert!(parse_file("no_such_limit = 1").is_err());
    }

    #[test]
    fn the_deployment_configs_parse() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
        let systemd = std::fs::read_to_string(format!("{root}/systemd/server.toml")).unwrap();
        // The ConfigMap's server.toml: the block indented under `server.toml: |`.
        let k8s = std::fs::read_to_string(format!("{root}/k8s/server.yaml")).unwrap();
        let block = k8s.split("server.toml: |\n").nth(1).unwrap();
        let embedded: String = block
            .lines()
            .take_while(|l| l.is_empty() || l.starts_with("    "))
            .map(|l| format!("{}\n", l.trim_start()))
            .collect();
        for text in [systemd, embedded] {
            let file: ConfigFile = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(file.datasets.len(), 1, "{text}");
            let mut limits = ServerLimits::default();
            file.limits.apply(&mut limits).unwrap();
            limits.validate().unwrap();
        }
    }

    #[test]
    fn a_wrong_limit_in_the_file_is_named() {
        let file: ConfigFile = toml::from_str("[limits]\nmax_connections = -1\n").unwrap();
        let e = file.limits.apply(&mut ServerLimits::default()).unwrap_err().to_string();
        assert!(e.starts_with("limits.max_connections: ") && e.contains("-1"), "{e}");
        let file: ConfigFile = toml::from_str("[limits]\nstorage_concurrency = 2.5\n").unwrap();
        assert!(file.limits.apply(&mut ServerLimits::default()).is_err());
    }

    #[test]
    fn limits_that_serve_nothing_are_refused() {
        let zero_bodies = ServerLimits { max_bodies_in_flight: 0, ..ServerLimits::default() };
        let e = zero_bodies.validate().unwrap_err();
        assert_eq!(e.to_string(), "max_bodies_in_flight must be at least 1, got 0");
        let tiny_headers = ServerLimits { max_header_bytes: 100, ..ServerLimits::default() };
        assert!(tiny_headers.validate().unwrap_err().to_string().starts_with("max_header_bytes"));
        let no_time = ServerLimits { request_timeout: Duration::ZERO, ..ServerLimits::default() };
        assert!(no_time.validate().unwrap_err().to_string().starts_with("request_timeout"));
        for zero in [
            ServerLimits { max_send_buf_size: 0, ..ServerLimits::default() },
            ServerLimits { idle_timeout: Duration::ZERO, ..ServerLimits::default() },
            ServerLimits { object_timeout: Duration::ZERO, ..ServerLimits::default() },
        ] {
            assert!(zero.validate().unwrap_err().to_string().contains("must be at least 1, got 0"));
        }
        // No dataset mapped (every shard read with positioned reads) serves: it was refused.
        ServerLimits { max_mapped_shards: 0, ..ServerLimits::default() }.validate().unwrap();
    }

    /// `--disk-cache-size` without `--disk-cache` was taken without a word: no tier, no room.
    #[test]
    fn a_tier_size_without_a_tier_is_refused() {
        use crate::policy::{AutoSize, TierDir};
        let sized = ServerLimits { disk_cache_size: AutoSize::Bytes(1 << 30), ..ServerLimits::default() };
        let e = sized.validate().unwrap_err().to_string();
        assert_eq!(e, "disk_cache_size is set but disk_cache is not: disk_cache_size has no effect without it");
        let tier = TierDir(Some("/srv/tier".into()));
        ServerLimits { disk_cache: tier, ..sized }.validate().unwrap();
    }

    #[test]
    fn defaults_fit_a_long_fat_link() {
        let l = ServerLimits::default();
        l.validate().unwrap();
        // A connection must not be capped below 1 GB/s at 30 ms RTT: window / RTT >= 1e9.
        assert!(f64::from(l.connection_window) / 0.030 >= 1e9);
    }

    #[test]
    fn dataset_specs() {
        let d: DatasetSpec = "in=/data/x".parse().unwrap();
        assert_eq!((d.name.as_str(), d.path.to_str().unwrap()), ("in", "/data/x"));
        assert!("noequals".parse::<DatasetSpec>().is_err());
        assert!("a/b=/x".parse::<DatasetSpec>().is_err());
        for bad in ["", ".", "..", "../x", "a?b", "a#b", "a%20b", "tab\there"] {
            assert!(check_dataset_name(bad).is_err(), "{bad:?}");
        }
        for good in ["imagenet", "a.b", "ImageNet-1k_v2", "训练"] {
            assert!(check_dataset_name(good).is_ok(), "{good:?}");
        }
    }

    /// A store's URL other than s3:// is refused as such: it was looked for as a directory ("gs://b/p is not
    /// a directory").
    #[test]
    fn only_s3_stores_are_taken() {
        for url in ["gs://b/p", "az://c/p", "https://host/p", "abfs://c@a/p", "file:///data/x"] {
            let e = format!("x={url}").parse::<DatasetSpec>().unwrap_err();
            assert_eq!(e, ValueError::UnsupportedStore { path: url.into() });
            assert!(e.to_string().starts_with(&format!("{url}: only s3:// object stores are supported")), "{e}");
        }
        for path in ["s3://b/p", "s3a://b/p", "/data/x", "relative/dir", "./odd://name"] {
            assert!(format!("x={path}").parse::<DatasetSpec>().is_ok(), "{path}");
        }
    }
}
