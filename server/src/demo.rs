//! `batchfs-server demo`: the server alone, without a mount (the README's first command is `batchfs-lab
//! demo`, which mounts). Generates a sample dataset, serves it on loopback, reads one epoch over HTTP/2
//! with several concurrent streams as a loader would, verifies every batch's CRC32C against the manifest,
//! and prints a result table.

use crate::catalog::{Catalog, Dataset};
use crate::config::ServerLimits;
use crate::progress::IndexProgress;
use crate::ServeOptions;
use anyhow::{Context, Result};
use batchfs::api::{self, BatchQuery, Manifest};
use batchfs::demo::{SampleArgs, Table, Tally};
use batchfs::gen;
use batchfs::source::IndexOptions;
use clap::Args;
use futures_util::StreamExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Concurrent HTTP/2 streams reading batches, at least 1.
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub streams: usize,
    /// Batch file format to read (tfrecord or tar).
    #[arg(long, default_value = "tfrecord")]
    pub format: batchfs::encode::BatchFormat,
    /// Keep the dataset in DIR instead of a temporary directory (reused if present).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// The outcome of reading one epoch over HTTP.
#[derive(Debug, Clone)]
pub struct EpochRead {
    /// Batches read and checked against the manifest.
    pub tally: Tally,
    /// Batches the manifest lists.
    pub expected: usize,
    pub elapsed: Duration,
    pub http2: bool,
}

/// An HTTP/2 (prior knowledge) client with windows sized like the server's.
fn h2_client() -> Result<reqwest::Client> {
    let limits = ServerLimits::default();
    Ok(reqwest::Client::builder()
        .http2_prior_knowledge()
        .http2_initial_stream_window_size(limits.stream_window)
        .http2_initial_connection_window_size(limits.connection_window)
        .http2_max_frame_size(limits.max_frame_size)
        .build()?)
}

/// `response` if it succeeded, else the server's refusal with its reason (the body: "batch_size must be
/// ...", not only "400 Bad Request").
async fn answered(response: reqwest::Response) -> Result<reqwest::Response> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let url = response.url().clone();
    let reason = response.text().await.unwrap_or_default();
    anyhow::bail!("{url} answered {status}: {}", reason.trim())
}

/// Reads every batch of one epoch with `streams` concurrent requests, checking each body's CRC32C.
async fn read_epoch(
    client: &reqwest::Client,
    base: &str,
    dataset: &str,
    epoch: u64,
    query: BatchQuery,
    streams: usize,
) -> Result<EpochRead> {
    let url = format!("{base}{}?{}", api::manifest_path(dataset, epoch), query.to_query());
    let manifest: Manifest = answered(client.get(&url).send().await?).await?.json().await.context("manifest")?;
    let started = Instant::now();
    let results = futures_util::stream::iter(manifest.batches.clone())
        .map(|entry| {
            let url = format!("{base}{}?{}", api::batch_path(dataset, epoch, entry.index), query.to_query());
            let client = client.clone();
            async move {
                let mut response = answered(client.get(&url).send().await?).await?;
                let http2 = response.version() == reqwest::Version::HTTP_2;
                let (mut crc, mut len) = (0u32, 0u64);
                while let Some(chunk) = response.chunk().await? {
                    crc = batchfs::crc::crc32c_append(crc, &chunk);
                    len += chunk.len() as u64;
                }
                Ok::<_, anyhow::Error>((entry, len, crc, http2))
            }
        })
        .buffer_unordered(streams.max(1))
        .collect::<Vec<_>>()
        .await;
    let elapsed = started.elapsed();
    let mut out = EpochRead { tally: Tally::default(), expected: manifest.batches.len(), elapsed, http2: true };
    for r in results {
        let (entry, len, crc, http2) = r?;
        out.tally.check(epoch, &entry, len, crc)?;
        out.http2 &= http2;
    }
    Ok(out)
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> Result<()> {
    let temp;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => {
            temp = tempfile::tempdir()?;
            temp.path().join("sample-tfrecord")
        }
    };
    let options = args.sample.dataset();
    let t = Instant::now();
    if !dir.exists() {
        gen::generate(&options, &dir)?;
    }
    let gen_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let progress = IndexProgress::new("sample");
    let io = crate::config::ServerLimits::default().io_policy();
    let dataset = Dataset::open("sample", &dir, None, &IndexOptions::default(), &progress, io)?;
    let index_secs = t.elapsed().as_secs_f64();
    let info = dataset.info();
    let catalog = Catalog::default();
    catalog.insert(dataset)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let query = BatchQuery {
        plan: batchfs::plan::PlanOptions { batch_size: args.sample.batch_size, ..Default::default() },
        format: args.format,
    };
    let read = runtime.block_on(async {
        let server = crate::start(
            catalog,
            ServeOptions { listen: "127.0.0.1:0".parse()?, tls: None, token: None, limits: ServerLimits::default() },
        )
        .await?;
        let base = format!("http://{}", server.local_addr());
        let read = read_epoch(&h2_client()?, &base, "sample", 0, query, args.streams).await;
        server.shutdown().await;
        read
    })?;
    let secs = read.elapsed.as_secs_f64();
    let Tally { batches, bytes } = read.tally;
    let protocol = if read.http2 { "HTTP/2 (h2c)" } else { "HTTP/1.1" };
    let table = Table {
        title: "batchfs-lab demo: one epoch of a generated TFRecord dataset served over HTTP/2 on loopback".into(),
        rows: vec![
            (
                "dataset",
                format!("{} samples, {:.1} MB in {} shards", info.samples, info.bytes as f64 / 1e6, info.shards),
            ),
            ("generated / indexed", format!("{gen_secs:.2} s / {index_secs:.2} s")),
            ("plan", format!("epoch 0, batch_size {}, global shuffle, seed 0", args.sample.batch_size)),
            ("protocol", format!("{protocol}, {} concurrent streams", args.streams)),
            ("batches", format!("{batches} ({} format)", args.format)),
            ("bytes", format!("{:.1} MB", bytes as f64 / 1e6)),
            ("seconds", format!("{secs:.3}")),
            ("throughput", format!("{:.0} MB/s, {:.1} batches/s", bytes as f64 / 1e6 / secs, batches as f64 / secs)),
            ("checksums", format!("{batches}/{} batches verified (CRC32C)", read.expected)),
        ],
    };
    println!("\n{table}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--streams 0` is refused (it ran, with one stream).
    #[test]
    fn zero_streams_are_refused() {
        use clap::Parser;
        let streams = |n: &str| match crate::cli::Cli::try_parse_from(["batchfs-server", "demo", "--streams", n]) {
            Ok(crate::cli::Cli { command: crate::cli::Command::Demo(args) }) => Ok(args.streams),
            Ok(_) => unreachable!(),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(streams("3"), Ok(3));
        let e = streams("0").unwrap_err();
        assert!(e.contains("invalid value '0' for '--streams <STREAMS>'"), "{e}");
    }

    /// A request the server refuses fails with the server's reason, not only its status.
    #[test]
    fn a_refused_read_says_the_server_s_reason() {
        let server = crate::testing::serve_generated(20, 1000, None);
        let (base, dataset) = server.url.rsplit_once('/').unwrap();
        let plan = batchfs::plan::PlanOptions { batch_size: 0, ..Default::default() };
        let query = BatchQuery { plan, format: batchfs::encode::BatchFormat::Tfrecord };
        let read = server.runtime.block_on(async { read_epoch(&h2_client()?, base, dataset, 0, query, 2).await });
        let e = format!("{:#}", read.unwrap_err());
        assert!(e.contains("answered 400 Bad Request: ") && e.contains("batch_size"), "{e}");
    }
}
