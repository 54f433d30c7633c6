//! Server configuration: limits with safe defaults, and the TOML config file (an alternative to the
//! command line; flags given on the command line override the file).

use batchfs::index::SourceFormat;
use batchfs::units::{parse_duration, parse_size};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

/// Every limit of the server. Defaults are documented in `docs/CONFIGURATION.md`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerLimits {
    /// HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
    /// Largest request header block (HTTP/2 header list, HTTP/1 buffer).
    pub max_header_bytes: u32,
    /// Streams reset by the client before the server accepted them, per connection (rapid reset,
    /// CVE-2023-44487): past this the connection is closed.
    pub max_pending_accept_reset_streams: usize,
    /// Streams the server may reset because of client errors, per connection.
    pub max_local_error_reset_streams: usize,
    /// HTTP/2 per-stream receive window the server advertises.
    pub stream_window: u32,
    /// HTTP/2 connection receive window.
    pub connection_window: u32,
    /// Largest HTTP/2 frame the server accepts.
    pub max_frame_size: u32,
    /// Bytes buffered per stream for sending.
    pub max_send_buf_size: usize,
    /// HTTP/2 ping interval on idle connections (dead peers are detected).
    pub keep_alive_interval: Duration,
    /// How long a ping may go unanswered.
    pub keep_alive_timeout: Duration,
    /// Time allowed for an HTTP/1 request head or a TLS handshake.
    pub header_read_timeout: Duration,
    /// A connection with no bytes moving for this long is closed.
    pub idle_timeout: Duration,
    /// Time allowed to produce a response head.
    pub request_timeout: Duration,
    /// On shutdown, time allowed for in-flight responses to finish.
    pub drain_timeout: Duration,
    /// Open connections at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Concurrent blocking storage reads (page faults, warming), server-wide.
    pub storage_concurrency: usize,
    /// Batches of the same plan warmed ahead of each batch request.
    pub readahead_batches: u64,
    /// Largest body chunk handed to HTTP at once.
    pub chunk_size: u64,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_concurrent_streams: 256,
            max_header_bytes: 16 << 10,
            max_pending_accept_reset_streams: 20,
            max_local_error_reset_streams: 1024,
            stream_window: 16 << 20,
            connection_window: 64 << 20,
            max_frame_size: 1 << 20,
            max_send_buf_size: 4 << 20,
            keep_alive_interval: Duration::from_secs(20),
            keep_alive_timeout: Duration::from_secs(20),
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(300),
            request_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(30),
            max_connections: 4096,
            storage_concurrency: 16,
            readahead_batches: 4,
            chunk_size: 1 << 20,
        }
    }
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
}

impl std::str::FromStr for DatasetSpec {
    type Err = String;

    /// `NAME=PATH`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, path) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected NAME=PATH"))?;
        if name.is_empty() || path.is_empty() {
            return Err(format!("{s:?}: expected NAME=PATH with both parts non-empty"));
        }
        if name.contains(['/', '?', '#', '%']) {
            return Err(format!("dataset name {name:?} must not contain '/', '?', '#' or '%'"));
        }
        Ok(DatasetSpec { name: name.to_owned(), path: PathBuf::from(path), format: None })
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
    pub token_file: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    #[serde(default)]
    pub limits: LimitsFile,
}

/// `[limits]` of the config file: sizes as `"16M"` or integers, durations as `"30s"`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsFile {
    pub max_concurrent_streams: Option<u32>,
    pub max_header_bytes: Option<SizeValue>,
    pub max_pending_accept_reset_streams: Option<usize>,
    pub max_local_error_reset_streams: Option<usize>,
    pub stream_window: Option<SizeValue>,
    pub connection_window: Option<SizeValue>,
    pub max_frame_size: Option<SizeValue>,
    pub max_send_buf_size: Option<SizeValue>,
    pub keep_alive_interval: Option<String>,
    pub keep_alive_timeout: Option<String>,
    pub header_read_timeout: Option<String>,
    pub idle_timeout: Option<String>,
    pub request_timeout: Option<String>,
    pub drain_timeout: Option<String>,
    pub max_connections: Option<usize>,
    pub storage_concurrency: Option<usize>,
    pub readahead_batches: Option<u64>,
    pub chunk_size: Option<SizeValue>,
}

/// A size written as an integer or a string with a suffix.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn get(&self) -> Result<u64, String> {
        match self {
            SizeValue::Bytes(n) => Ok(*n),
            SizeValue::Text(s) => parse_size(s),
        }
    }
}

fn to_u32(name: &str, v: u64) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("limits.{name} = {v} is too large"))
}

impl LimitsFile {
    /// Applies the values present to `limits`.
    pub fn apply(&self, limits: &mut ServerLimits) -> Result<(), String> {
        macro_rules! set {
            ($field:ident) => {
                if let Some(v) = self.$field {
                    limits.$field = v;
                }
            };
            ($field:ident, size32) => {
                if let Some(v) = &self.$field {
                    limits.$field = to_u32(stringify!($field), v.get()?)?;
                }
            };
            ($field:ident, size) => {
                if let Some(v) = &self.$field {
                    limits.$field = v.get()? as _;
                }
            };
            ($field:ident, duration) => {
                if let Some(v) = &self.$field {
                    limits.$field = parse_duration(v).map_err(|e| format!("limits.{}: {e}", stringify!($field)))?;
                }
            };
        }
        set!(max_concurrent_streams);
        set!(max_header_bytes, size32);
        set!(max_pending_accept_reset_streams);
        set!(max_local_error_reset_streams);
        set!(stream_window, size32);
        set!(connection_window, size32);
        set!(max_frame_size, size32);
        set!(max_send_buf_size, size);
        set!(keep_alive_interval, duration);
        set!(keep_alive_timeout, duration);
        set!(header_read_timeout, duration);
        set!(idle_timeout, duration);
        set!(request_timeout, duration);
        set!(drain_timeout, duration);
        set!(max_connections);
        set!(storage_concurrency);
        set!(readahead_batches);
        set!(chunk_size, size);
        Ok(())
    }
}

impl ServerLimits {
    /// Rejects values hyper or the protocol would refuse.
    pub fn validate(&self) -> Result<(), String> {
        if !(16_384..=16_777_215).contains(&self.max_frame_size) {
            return Err(format!("max_frame_size must be between 16K and 16M-1, got {}", self.max_frame_size));
        }
        if self.stream_window > i32::MAX as u32 || self.connection_window > i32::MAX as u32 {
            return Err("HTTP/2 windows must be below 2 GiB".into());
        }
        if self.max_connections == 0 || self.max_concurrent_streams == 0 || self.storage_concurrency == 0 {
            return Err("max_connections, max_concurrent_streams and storage_concurrency must be at least 1".into());
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
    }
}
