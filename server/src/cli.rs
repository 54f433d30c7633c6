//! The `batchfs-server` command line: `serve`, `index`, `gen` and `demo`.

use crate::catalog::{Catalog, Dataset};
use crate::config::{ConfigFile, DatasetSpec, LimitArgs, ServerLimits};
use crate::objects::{is_object_url, ObjectContext, ObjectsAt};
use crate::progress::IndexProgress;
use crate::storage::IoPolicy;
use crate::{ServeOptions, TlsFiles};
use anyhow::{bail, Context, Result};
use batchfs::gen::{self, GenOptions};
use batchfs::index::SourceFormat;
use batchfs::source::{IndexOptions, IndexOrigin};
use batchfs::units::parse_size;
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// batchfs storage-side server: indexes datasets once and serves pre-batched batch files over HTTP/2.
#[derive(Debug, Parser)]
#[command(name = "batchfs-server", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve datasets over HTTP/2 (h2c or TLS) and HTTP/1.1.
    Serve(Box<ServeArgs>),
    /// Build (or refresh) the index of datasets ahead of serving.
    Index(IndexArgs),
    /// Write a synthetic dataset in a real on-disk format.
    Gen(GenArgs),
    /// Generate a sample dataset, serve it on loopback and read one epoch over HTTP/2, with a result table.
    Demo(crate::demo::DemoArgs),
}

/// How datasets are indexed.
#[derive(Debug, Args, Clone)]
pub struct IndexFlags {
    /// Dataset to serve, as NAME=PATH (repeatable).
    #[arg(long = "dataset", value_name = "NAME=PATH", help_heading = "Datasets")]
    pub datasets: Vec<DatasetSpec>,
    /// Force the source format of every dataset, over the config file's (tfrecord, lmdb, tar, files); detected by
    /// default.
    #[arg(long, value_name = "FORMAT", help_heading = "Datasets")]
    pub format: Option<SourceFormat>,
    /// Keep indexes in DIR (as NAME.batchfs-index) instead of beside the data.
    #[arg(long, value_name = "DIR", help_heading = "Datasets")]
    pub index_dir: Option<PathBuf>,
    /// Keep the index of every s3:// dataset in its bucket too (PREFIX/.batchfs-index) and reuse it from
    /// there: servers started later (replicas) read no sample to start.
    #[arg(long, help_heading = "Datasets")]
    pub index_in_bucket: bool,
    /// Index around corrupt records and tar members, listing what was skipped, instead of failing.
    #[arg(long, help_heading = "Datasets")]
    pub skip_corrupt: bool,
    /// Follow symbolic links that lead out of a local dataset's directory too (by default those are left
    /// out with a warning: a link planted in a dataset would serve any file the server can read).
    #[arg(long, help_heading = "Datasets")]
    pub follow_links: bool,
    /// Do not check TFRecord data CRCs while indexing (faster; length CRCs are always checked, and
    /// clients still verify every batch end to end).
    #[arg(long, help_heading = "Datasets")]
    pub no_verify_data_crc: bool,
}

#[derive(Debug, Args)]
pub struct IndexArgs {
    /// TOML config file, as `serve` reads it: its datasets, index_dir, indexing switches and `[limits]`
    /// (command-line flags override it).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub index: IndexFlags,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML config file (see docs/CONFIGURATION.md); command-line flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to listen on (or `listen` in the config). [default: 0.0.0.0:7878]
    #[arg(long, value_name = "ADDR", help_heading = "Network")]
    pub listen: Option<SocketAddr>,
    /// File holding the bearer token every request but /healthz must carry.
    #[arg(long, value_name = "FILE", help_heading = "Security")]
    pub token_file: Option<PathBuf>,
    /// PEM certificate chain: serve TLS (ALPN h2, http/1.1); with --tls-key, or the config's tls_key.
    #[arg(long, value_name = "FILE", help_heading = "Security")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert (or for the config's tls_cert).
    #[arg(long, value_name = "FILE", help_heading = "Security")]
    pub tls_key: Option<PathBuf>,
    /// Record energy per sensor every 100 ms with the bytes served, as JSON lines (see docs/ENERGY.md).
    #[arg(long, value_name = "FILE")]
    pub energy_log: Option<PathBuf>,
    #[command(flatten)]
    pub index: IndexFlags,
    #[command(flatten)]
    pub limits: LimitArgs,
}

#[derive(Debug, Args)]
pub struct GenArgs {
    /// Source format to write.
    #[arg(long, value_name = "FORMAT")]
    pub format: SourceFormat,
    /// Number of samples.
    #[arg(long, default_value_t = 2000)]
    pub samples: u32,
    /// Mean sample size.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "110000")]
    pub mean_bytes: u64,
    /// Size distribution: imagenet (log-normal, σ 0.5, and 1 % of samples 10-50 times the mean, as
    /// ImageNet's largest JPEGs are) or lognormal (the bulk alone, at most 8 times the mean)
    #[arg(long, value_name = "DIST", default_value = "imagenet")]
    pub sizes: gen::Sizes,
    /// Shards (TFRecord and tar).
    #[arg(long, default_value_t = 16)]
    pub shards: u32,
    /// Number of classes (labels).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub classes: u32,
    /// Seed: the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (created).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// Entry point of the binary.
/// `e` and its causes, `: `-separated, each cause left out where an earlier message already says it (an
/// object store's errors quote their sources: a missing bucket's cause came five times over).
pub fn error_text(e: &anyhow::Error) -> String {
    let mut said: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !said.iter().any(|s| s.contains(&text)) {
            said.push(text);
        }
    }
    said.join(": ")
}

pub fn run() -> Result<()> {
    let cli = Cli::parse();
    init_tracing();
    if let Some(arenas) = crate::policy::limit_malloc_arenas() {
        tracing::debug!(arenas, "malloc arenas capped");
    }
    match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Index(args) => index(args),
        Command::Gen(args) => generate(args),
        Command::Demo(args) => crate::demo::run(args),
    }
}

fn init_tracing() {
    batchfs::process::init_logs("info", None);
}

/// Opens every dataset, indexing where needed, with progress and a summary line each.
/// Datasets are read as `io` says: mapped, or by positioned reads (see `storage.rs`).
pub fn open_catalog(flags: &IndexFlags, extra: &[DatasetSpec], limits: &ServerLimits) -> Result<Catalog> {
    let catalog = Catalog::default();
    let specs = dataset_specs(flags, extra)?;
    fill_catalog(&catalog, &specs, flags, limits.io_policy(), &objects_context(&specs, limits)?)?;
    Ok(catalog)
}

/// What the object datasets of `specs` will share: the runtime, the block cache and the disk tier (opened
/// now: a tier that cannot be used stops the server with why). `None` where no dataset is in a store.
fn objects_context(specs: &[DatasetSpec], limits: &ServerLimits) -> Result<Option<Arc<ObjectContext>>> {
    if !specs.iter().any(|s| is_object_url(&s.path)) {
        if let Some(dir) = &limits.disk_cache.0 {
            tracing::warn!(dir = %dir.display(), "disk_cache is for s3:// datasets: no dataset uses it");
        }
        return Ok(None);
    }
    Ok(Some(ObjectContext::new(limits)?))
}

/// The datasets of the command line and the config file.
fn dataset_specs(flags: &IndexFlags, extra: &[DatasetSpec]) -> Result<Vec<DatasetSpec>> {
    let specs: Vec<DatasetSpec> = extra.iter().chain(&flags.datasets).cloned().collect();
    if specs.is_empty() {
        bail!("no dataset given: pass --dataset NAME=PATH (or [[dataset]] in --config)");
    }
    // The flag's are checked as they parse; the config file's here, before anything is served.
    for spec in extra {
        crate::config::check_dataset_name(&spec.name).context("in the config file's [[dataset]]")?;
        crate::config::check_dataset_path(&spec.path).with_context(|| format!("dataset {}", spec.name))?;
        if !is_object_url(&spec.path) && (!spec.s3.is_empty() || spec.index_in_bucket) {
            bail!(
                "dataset {}: [dataset.s3] settings and index_in_bucket are for s3:// datasets, not {}",
                spec.name,
                spec.path.display()
            );
        }
    }
    if flags.index_in_bucket && !specs.iter().any(|s| is_object_url(&s.path)) {
        // The flag is for every s3:// dataset of the server: none here to keep an index for.
        bail!("--index-in-bucket is for s3:// datasets: no dataset given is in an object store");
    }
    Ok(specs)
}

/// Opens each dataset of `specs` in turn and inserts it into `catalog` when ready (reporting progress to
/// the catalog for the datasets it announced).
fn fill_catalog(
    catalog: &Catalog,
    specs: &[DatasetSpec],
    flags: &IndexFlags,
    mut io: IoPolicy,
    objects: &Option<Arc<ObjectContext>>,
) -> Result<()> {
    for spec in specs {
        let options = index_options(spec, flags);
        let started = Instant::now();
        let progress = IndexProgress::new(&spec.name).reporting_to(catalog);
        let index_dir = flags.index_dir.as_deref();
        let dataset = if is_object_url(&spec.path) {
            let url = spec.path.to_string_lossy();
            let index_in_bucket = spec.index_in_bucket || flags.index_in_bucket;
            let context = objects.clone().expect("a context for object datasets");
            let at = ObjectsAt { url: &url, settings: &spec.s3, index_in_bucket, context };
            Dataset::open_objects(&spec.name, at, index_dir, &options, &progress, io)
        } else {
            Dataset::open(&spec.name, &spec.path, index_dir, &options, &progress, io)
        };
        progress.finish();
        let dataset = dataset?;
        // What this dataset holds in memory is not there for the next (`resident` is server-wide).
        io.resident -= dataset.storage.resident();
        let info = dataset.info();
        tracing::info!(
            dataset = %info.name, format = %info.format, samples = info.samples, bytes = info.bytes,
            shards = info.shards,
            skipped = info.skipped, seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
            index = if dataset.origin == IndexOrigin::Loaded { "loaded" } else { "built" },
            "dataset ready"
        );
        for s in &dataset.index.skipped {
            let (shard, reason) = (&s.shard, &s.reason);
            tracing::warn!(dataset = %info.name, %shard, offset = s.offset, %reason, "skipped corrupt data");
        }
        catalog.insert(dataset)?;
    }
    Ok(())
}

/// How `spec` is indexed: `--format`, a flag, forces every dataset's format over the config file's
/// `format` (the file's won, and the flag was dropped without a word).
fn index_options(spec: &DatasetSpec, flags: &IndexFlags) -> IndexOptions {
    IndexOptions {
        format: flags.format.or(spec.format),
        verify_data_crc: !flags.no_verify_data_crc,
        skip_corrupt: flags.skip_corrupt,
        follow_links: flags.follow_links,
    }
}

fn index(args: IndexArgs) -> Result<()> {
    let started = Instant::now();
    let mut limits = ServerLimits::default();
    let file = read_config(args.config.as_deref(), &mut limits)?;
    limits.validate().context("invalid limits (the config's [limits])")?;
    let flags = with_config(args.index, &file)?;
    let catalog = open_catalog(&flags, &file.datasets, &limits)?;
    println!(
        "{:<16} {:>8} {:>10} {:>14} {:>8} {:>8} {:>9}",
        "dataset", "format", "samples", "bytes", "shards", "skipped", "index"
    );
    for ds in catalog.datasets() {
        let i = ds.info();
        let origin = if ds.origin == IndexOrigin::Loaded { "reused" } else { "built" };
        println!(
            "{:<16} {:>8} {:>10} {:>14} {:>8} {:>8} {:>9}",
            i.name,
            i.format.as_str(),
            i.samples,
            i.bytes,
            i.shards,
            i.skipped,
            origin
        );
    }
    println!("indexed in {:.2} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn generate(args: GenArgs) -> Result<()> {
    let options = GenOptions {
        format: args.format,
        samples: args.samples,
        mean_bytes: args.mean_bytes,
        shards: args.shards,
        classes: args.classes,
        seed: args.seed,
        sizes: args.sizes,
    };
    let started = Instant::now();
    let summary = gen::generate(&options, &args.out)?;
    println!(
        "wrote {} {} samples ({} bytes of payload) in {} files to {} in {:.2} s",
        summary.samples,
        args.format,
        summary.bytes,
        summary.files,
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn read_token(path: &Path) -> Result<Vec<u8>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read token file {}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        bail!("token file {} is empty", path.display());
    }
    Ok(token.as_bytes().to_vec())
}

/// The config file at `path` (none: an empty one), its `[limits]` applied to `limits`.
fn read_config(path: Option<&std::path::Path>, limits: &mut ServerLimits) -> Result<ConfigFile> {
    let Some(path) = path else { return Ok(ConfigFile::default()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
    let file: ConfigFile = toml::from_str(&text).with_context(|| format!("invalid config {}", path.display()))?;
    file.limits.apply(limits).with_context(|| format!("invalid config {}", path.display()))?;
    Ok(file)
}

/// The indexing flags with what the config file says where they say nothing.
fn with_config(mut flags: IndexFlags, file: &ConfigFile) -> Result<IndexFlags> {
    flags.index_dir = flags.index_dir.or(file.index_dir.clone());
    // Said now, naming it: an object dataset's first staged copy failed with "cannot read s3://...: File
    // exists", blaming an object.
    if let Some(dir) = flags.index_dir.as_deref().filter(|d| d.exists() && !d.is_dir()) {
        bail!("index_dir {}: not a directory (give a directory for the datasets' indexes)", dir.display());
    }
    flags.skip_corrupt |= file.skip_corrupt.unwrap_or(false);
    flags.follow_links |= file.follow_links.unwrap_or(false);
    flags.no_verify_data_crc |= !file.verify_data_crc.unwrap_or(true);
    Ok(flags)
}

fn serve(args: ServeArgs) -> Result<()> {
    let mut limits = ServerLimits::default();
    let file = read_config(args.config.as_deref(), &mut limits)?;
    args.limits.apply(&mut limits);
    limits.validate().context("invalid limits (the flags, and the config's [limits])")?;
    batchfs::process::raise_open_files_limit();
    let listen = match (args.listen, &file.listen) {
        (Some(a), _) => a,
        (None, Some(s)) => s.parse().with_context(|| format!("invalid listen address {s:?} in the config"))?,
        (None, None) => "0.0.0.0:7878".parse().expect("valid"),
    };
    let flags = with_config(args.index.clone(), &file)?;
    let token = args.token_file.as_ref().or(file.token_file.as_ref()).map(|p| read_token(p)).transpose()?;
    let tls = tls_files(args.tls_cert, args.tls_key, &file)?;
    // The server answers while it indexes: every dataset is announced now, opened in the background,
    // and served once ready (`/healthz` says which are; a dataset that cannot be opened stops the server).
    let specs = dataset_specs(&flags, &file.datasets)?;
    let catalog = Arc::new(Catalog::default());
    for spec in &specs {
        catalog.announce(&spec.name)?;
    }
    let io = limits.io_policy();
    let objects = objects_context(&specs, &limits)?;
    let energy_log = args.energy_log.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(async move {
        // Handlers first: a SIGTERM that arrives while starting up must stop the server, not kill it.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let energy = match &energy_log {
            Some(path) => Some(
                batchfs_energy::EnergyLog::prepare(path)
                    .with_context(|| format!("cannot write --energy-log {}", path.display()))?,
            ),
            None => None,
        };
        let server = crate::start(catalog.clone(), ServeOptions { listen, tls, token, limits }).await?;
        let energy = energy.map(|log| log.start(Duration::from_millis(100), server.bytes_sent()));
        let stop = server.shutdown_handle();
        let opening = tokio::task::spawn_blocking({
            let stop = stop.clone();
            move || {
                // A panic while opening (a bug) stops the server as a failure does: it was left serving
                // 503s, indexing forever.
                let _stop_on_panic = OnPanic(|| {
                    let _ = stop.send(true);
                });
                let result = fill_catalog(&catalog, &specs, &flags, io, &objects);
                match &result {
                    Ok(()) => tracing::info!("every dataset is ready"),
                    Err(e) => {
                        tracing::error!(error = %error_text(e), "a dataset cannot be served: stopping");
                        let _ = stop.send(true);
                    }
                }
                result
            }
        });
        let signalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        tokio::spawn({
            let signalled = signalled.clone();
            async move {
                let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
                loop {
                    tokio::select! {
                        _ = term.recv() => break,
                        _ = tokio::signal::ctrl_c() => break,
                        // Its default killed the server without a word.
                        Some(()) = async { hup.as_mut().ok()?.recv().await } => tracing::warn!(
                            "SIGHUP ignored: the server reloads nothing (restart it to apply a new configuration); \
                             SIGTERM stops it"
                        ),
                    }
                }
                tracing::info!("signal received: finishing in-flight batches");
                signalled.store(true, std::sync::atomic::Ordering::SeqCst);
                let _ = stop.send(true);
            }
        });
        server.wait().await;
        if let Some(log) = energy {
            log.finish(0.35).context("writing the energy log summary")?;
        }
        tracing::info!("stopped");
        // Indexing that failed is the exit's reason (it stopped the server, and may not have returned
        // yet: waiting for it is the only way to know); one still running when a signal came is left
        // behind.
        if !signalled.load(std::sync::atomic::Ordering::SeqCst) || opening.is_finished() {
            opening.await.context("the indexing task")??;
        }
        Ok(())
    });
    // An indexing task still running (a signal came first) must not hold the exit up.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// The TLS certificate and key, each from its flag or else from the config file (a flag overrides the
/// file's value, and pairs with the file's other half); a half given nowhere is refused, naming it.
fn tls_files(cert: Option<PathBuf>, key: Option<PathBuf>, file: &ConfigFile) -> Result<Option<TlsFiles>> {
    let cert = cert.map(|p| (p, "--tls-cert")).or(file.tls_cert.clone().map(|p| (p, "tls_cert")));
    let key = key.map(|p| (p, "--tls-key")).or(file.tls_key.clone().map(|p| (p, "tls_key")));
    match (cert, key) {
        (Some((cert, cert_setting)), Some((key, key_setting))) => {
            Ok(Some(TlsFiles { cert, key, cert_setting, key_setting }))
        }
        (None, None) => Ok(None),
        (Some((_, setting)), None) => {
            let missing = if setting == "tls_cert" { "tls_key" } else { "--tls-key" };
            bail!("{setting} without {missing}: TLS needs a key too (--tls-key FILE, or tls_key in the config)")
        }
        (None, Some((_, setting))) => {
            let missing = if setting == "tls_key" { "tls_cert" } else { "--tls-cert" };
            bail!(
                "{setting} without {missing}: TLS needs a certificate too (--tls-cert FILE, or tls_cert in the config)"
            )
        }
    }
}

/// Runs its closure when dropped by a panic's unwinding.
struct OnPanic<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnPanic<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The indexing flags of `serve` with nothing given.
    fn serve_flags() -> IndexFlags {
        match Cli::try_parse_from(["batchfs-server", "serve"]).unwrap().command {
            Command::Serve(a) => a.index,
            _ => unreachable!(),
        }
    }

    /// A config file's dataset in a store other than S3 is refused naming it, as the flag's is.
    #[test]
    fn a_config_file_s_dataset_in_another_store_is_refused() {
        let file: ConfigFile = toml::from_str("[[dataset]]\nname = \"g\"\npath = \"gs://b/p\"\n").unwrap();
        let flags = IndexFlags { datasets: Vec::new(), ..with_config(serve_flags(), &file).unwrap() };
        let e = format!("{:#}", dataset_specs(&flags, &file.datasets).unwrap_err());
        assert!(e.starts_with("dataset g: gs://b/p: only s3:// object stores are supported"), "{e}");
    }

    /// A TLS flag overrides the config file's value and pairs with its other half; a half given nowhere is
    /// refused naming it, as the flag or as the file's key.
    #[test]
    fn tls_flags_override_and_pair_with_the_config_file() {
        let file: ConfigFile = toml::from_str("tls_cert = \"/f/cert.pem\"\ntls_key = \"/f/key.pem\"").unwrap();
        let serve = |flags: &[&str]| {
            let args = ["batchfs-server", "serve", "--config", "c.toml"];
            match Cli::try_parse_from(args.iter().chain(flags)).unwrap_or_else(|e| panic!("{e}")).command {
                Command::Serve(a) => (a.tls_cert, a.tls_key),
                _ => unreachable!(),
            }
        };
        let files = |flags: &[&str], file: &ConfigFile| {
            let (cert, key) = serve(flags);
            tls_files(cert, key, file).map(|t| t.map(|t| (t.cert, t.key, t.cert_setting, t.key_setting)))
        };
        let p = PathBuf::from;
        let tls = files(&["--tls-cert", "/c.pem"], &file).unwrap();
        assert_eq!(tls, Some((p("/c.pem"), p("/f/key.pem"), "--tls-cert", "tls_key")));
        let tls = files(&["--tls-key", "/k.pem"], &file).unwrap();
        assert_eq!(tls, Some((p("/f/cert.pem"), p("/k.pem"), "tls_cert", "--tls-key")));
        let tls = files(&[], &file).unwrap();
        assert_eq!(tls, Some((p("/f/cert.pem"), p("/f/key.pem"), "tls_cert", "tls_key")));
        assert_eq!(files(&[], &ConfigFile::default()).unwrap(), None);
        let half = |flags: &[&str], file: &str| files(flags, &toml::from_str(file).unwrap()).unwrap_err().to_string();
        assert!(half(&["--tls-cert", "/c"], "").starts_with("--tls-cert without --tls-key: "));
        assert!(half(&["--tls-key", "/k"], "").starts_with("--tls-key without --tls-cert: "));
        assert!(half(&[], "tls_cert = \"/c\"").starts_with("tls_cert without tls_key: "));
        assert!(half(&[], "tls_key = \"/k\"").starts_with("tls_key without tls_cert: "));
    }

    /// `--format` forces the format of every dataset, the config file's included; without it each
    /// dataset's `format` holds.
    #[test]
    fn the_format_flag_overrides_the_config_file_s() {
        let file: ConfigFile = toml::from_str(
            "[[dataset]]\nname = \"a\"\npath = \"/d/a\"\nformat = \"lmdb\"\n\
             [[dataset]]\nname = \"b\"\npath = \"/d/b\"\n",
        )
        .unwrap();
        for command in ["serve", "index"] {
            let args = ["batchfs-server", command, "--config", "c.toml", "--dataset", "c=/d/c"];
            let flags = match Cli::try_parse_from(args.iter().chain(&["--format", "tfrecord"])).unwrap().command {
                Command::Serve(a) => a.index,
                Command::Index(a) => a.index,
                _ => unreachable!(),
            };
            let flags = with_config(flags, &file).unwrap();
            for spec in dataset_specs(&flags, &file.datasets).unwrap() {
                assert_eq!(index_options(&spec, &flags).format, Some(SourceFormat::Tfrecord), "{}", spec.name);
            }
            let unforced = IndexFlags { format: None, ..flags };
            let formats: Vec<_> = file.datasets.iter().map(|s| index_options(s, &unforced).format).collect();
            assert_eq!(formats, [Some(SourceFormat::Lmdb), None]);
        }
    }

    /// A cause an earlier message already quotes is said once.
    #[test]
    fn an_error_says_each_cause_once() {
        let root = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let e = anyhow::Error::new(root)
            .context("HTTP error: Connection refused")
            .context("Generic S3 error: HTTP error: Connection refused")
            .context("s3://b/d: cannot reach the store (Generic S3 error: HTTP error: Connection refused)");
        assert_eq!(
            super::error_text(&e),
            "s3://b/d: cannot reach the store (Generic S3 error: HTTP error: Connection refused)"
        );
        let e = anyhow::anyhow!("the root").context("what failed");
        assert_eq!(super::error_text(&e), "what failed: the root");
    }
}
