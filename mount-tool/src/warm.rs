//! Warming the node cache (`warm=raw`, and `batchfs warm` on its own): every file of a file-tree dataset
//! fetched into `cache_dir` ahead of its readers, as pre-batched bodies (`GET .../samples/data?ids=`, a
//! few megabytes each, several in flight) in the plan's order of the first epoch, each checked whole
//! against its samples' combined CRC32C and filed sample by sample under its content key: the key `raw/`
//! finds the file by and `shuffled/` the sample by. Files already there are skipped. Reads of files not
//! yet warm go on being fetched on demand, ahead of this.

use crate::buffers::{Filling, Sink};
use crate::client::{ClientError, DynClient, Request, Sent};
use crate::node_cache::{Key, NodeCache};
use crate::stats::Stats;
use batchfs::api::{SampleTable, MAX_SAMPLE_IDS};
use batchfs::plan::{EpochPlan, PlanOptions};
use futures_util::StreamExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Bytes of one warming request at most (a group of whole samples; a larger sample is one alone).
pub const WARM_REQUEST_BYTES: u64 = 8 << 20;
/// Warming requests in flight at once.
pub const WARM_IN_FLIGHT: usize = 8;
/// Attempts of one warming request at least before its files are left to be fetched on demand (more
/// while the `timeout` given to [`warm`] lasts).
const ATTEMPTS: u32 = 5;

/// `batchfs warm`: fills the node cache (`cache_dir`, which every mount of the node then reads before the
/// network) with the files below `dir` (`""`: all) of the file-tree dataset at `url`, without a mount, in
/// the first epoch's plan order, printing progress; the number of files it could not fetch.
pub fn command(url: &str, dir: &str, options: &crate::options::MountOptions) -> anyhow::Result<u64> {
    use anyhow::{bail, Context};
    let cache_path =
        options.cache_dir.as_ref().context("batchfs warm fills a node cache: give it one (-o cache_dir=PATH)")?;
    let http = crate::plan::http_config(url, options)?;
    let namespace = http.cache_namespace();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("batchfs-warm")
        .enable_all()
        .build()?;
    let client: DynClient = Arc::new(crate::client::HttpClient::new(http)?);
    let info = runtime.block_on(client.dataset()).context("cannot describe the dataset")?;
    // The table and the bodies of the index described, or none: a replica of another is passed over.
    client.expect_index(&info.index_id);
    if info.format != batchfs::index::SourceFormat::Files {
        bail!("batchfs warm warms a file tree's files; dataset {:?} is {} shards", info.name, info.format.as_str());
    }
    let cache = NodeCache::open(cache_path, options.cache_dir_size, &namespace)
        .with_context(|| format!("cannot use {}", cache_path.display()))?;
    let stats = Arc::new(Stats::default());
    let table = Arc::new(runtime.block_on(client.sample_table()).context("cannot fetch the sample table")?);
    if crate::prefetch::changed(&info.name, &info.index_id, &table.index_id, "sample table").is_some() {
        bail!(
            "dataset {:?} was indexed again with other files as warming began (its description says index {}, its \
             sample table index {}): run batchfs warm again",
            info.name,
            info.index_id,
            table.index_id
        );
    }
    let progress = {
        let stats = stats.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_secs(2));
            let s = stats.snapshot();
            let Some(w) = s.warm else { continue };
            eprintln!(
                "warm: {}/{} files, {:.1}/{:.1} MB",
                w.files,
                w.files_total,
                w.bytes as f64 / 1e6,
                w.bytes_total as f64 / 1e6
            );
            if w.files >= w.files_total {
                return;
            }
        })
    };
    let mut order = plan_order(&table, options.plan, options.first_epoch);
    if !dir.is_empty() {
        let below: std::collections::HashSet<u32> = runtime
            .block_on(samples_under(&client, dir))
            .with_context(|| format!("cannot list {dir:?} of the dataset"))?
            .into_iter()
            .collect();
        if below.is_empty() {
            bail!("the dataset has no file below {dir:?}");
        }
        order.retain(|id| below.contains(id));
    }
    let (held, wanted) = (cache.clone(), order.clone());
    let failed = runtime.block_on(warm(client, cache, table.clone(), order, stats.clone(), options.timeout));
    let s = stats.snapshot().warm.unwrap_or_default();
    drop(progress);
    println!(
        "warmed {}/{} files ({:.1} MB) into {} in {} s",
        s.files,
        s.files_total,
        s.bytes as f64 / 1e6,
        cache_path.display(),
        s.seconds
    );
    // Warmed is not kept: a cache smaller than the files evicts the first warmed for the last.
    let kept = wanted.iter().filter(|&&id| held.contains(key_of(&table, id))).count();
    // (Files whose fetch failed were never there: said apart, by the caller.)
    if kept + (failed as usize) < wanted.len() {
        println!(
            "the node cache holds {kept} of the {} files ({:.1} MB of its {:.1} MB): {} were evicted to make room \
             (it keeps 90 % of cache_dir_size, shared with any other dataset's files there); give cache_dir_size \
             at least {:.1} MB and room to spare to keep them all",
            wanted.len(),
            wanted.len() - kept - failed as usize,
            held.used() as f64 / 1e6,
            options.cache_dir_size as f64 / 1e6,
            s.bytes_total as f64 / 1e6
        );
    }
    Ok(failed)
}

/// The groups of samples to fetch: `order`'s samples not in `cache`, consecutive ones together up to
/// [`WARM_REQUEST_BYTES`] and [`MAX_SAMPLE_IDS`].
pub fn groups(table: &SampleTable, order: &[u32], cache: &NodeCache) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    let mut bytes = 0;
    for &id in order {
        let size = table.bytes[id as usize];
        if cache.contains(key_of(table, id)) {
            continue;
        }
        match out.last_mut() {
            Some(g) if bytes + size <= WARM_REQUEST_BYTES && g.len() < MAX_SAMPLE_IDS => {
                g.push(id);
                bytes += size;
            }
            _ => {
                out.push(vec![id]);
                bytes = size;
            }
        }
    }
    out
}

/// Sample `id`, as the node cache files it (the key `shuffled/` and `raw/` look it up by).
fn key_of(table: &SampleTable, id: u32) -> Key {
    Key::sample(Sent { bytes: table.bytes[id as usize], crc32c: table.crc32c[id as usize] }, id)
}

/// Every sample of `table`, in the order of epoch `epoch` of `plan`.
pub fn plan_order(table: &SampleTable, plan: PlanOptions, epoch: u64) -> Vec<u32> {
    EpochPlan::new(table.len() as u32, epoch, PlanOptions { drop_last: false, ..plan.per_sample() })
        .map(|p| p.order().to_vec())
        .unwrap_or_else(|_| (0..table.len() as u32).collect())
}

/// The samples of the files below directory `dir` of a file tree (`""`: all), every page of every
/// directory listed.
pub async fn samples_under(client: &DynClient, dir: &str) -> Result<Vec<u32>, ClientError> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.trim_matches('/').to_owned()];
    while let Some(dir) = dirs.pop() {
        let mut cursor = 0;
        loop {
            let page = client.files(&dir, cursor).await?;
            let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
            dirs.extend(page.dirs.iter().map(|d| format!("{prefix}{d}")));
            out.extend(page.files.iter().filter_map(|f| f.sample));
            match page.next {
                Some(n) if n > cursor => cursor = n,
                _ => break,
            }
        }
    }
    Ok(out)
}

/// Warms `cache` with the samples `order` of `table` (a file tree's files), in that order, counting
/// progress in `stats` (`warm_*`). Returns how many it could not fetch.
pub async fn warm(
    client: DynClient,
    cache: Arc<NodeCache>,
    table: Arc<SampleTable>,
    order: Vec<u32>,
    stats: Arc<Stats>,
    timeout: Duration,
) -> u64 {
    stats.warm_started.store(crate::stats::unix_now().max(1), Ordering::Relaxed);
    stats.warm_files_total.store(order.len() as u64, Ordering::Relaxed);
    stats.warm_bytes_total.store(order.iter().map(|&i| table.bytes[i as usize]).sum(), Ordering::Relaxed);
    let todo = {
        let (cache, table, order) = (cache.clone(), table.clone(), order.clone());
        tokio::task::spawn_blocking(move || groups(&table, &order, &cache)).await.unwrap_or_default()
    };
    let left: u64 = todo.iter().map(|g| g.len() as u64).sum();
    let left_bytes: u64 = todo.iter().flatten().map(|&i| table.bytes[i as usize]).sum();
    Stats::add(&stats.warm_files, order.len() as u64 - left);
    Stats::add(&stats.warm_bytes, stats.warm_bytes_total.load(Ordering::Relaxed) - left_bytes);
    tracing::info!(files = left, bytes = left_bytes, "warming the node cache");
    let failed = futures_util::stream::iter(todo.into_iter().map(|ids| {
        let (client, cache, table, stats) = (client.clone(), cache.clone(), table.clone(), stats.clone());
        async move {
            match fetch_group(&client, &cache, &table, &ids, timeout).await {
                Ok(bytes) => {
                    Stats::add(&stats.warm_files, ids.len() as u64);
                    Stats::add(&stats.warm_bytes, bytes);
                    0
                }
                Err(e) => {
                    let samples = ids.len();
                    tracing::warn!(samples, error = %e, "warming: a request failed; its files are fetched on demand");
                    ids.len() as u64
                }
            }
        }
    }))
    .buffer_unordered(WARM_IN_FLIGHT)
    .fold(0, |n, f| async move { n + f })
    .await;
    tracing::info!(failed, "warming the node cache: done");
    failed
}

/// Why a group of samples was not warmed (its files are then fetched on demand).
#[derive(Debug, thiserror::Error)]
enum WarmError {
    #[error(transparent)]
    Client(ClientError),
    #[error("{samples} samples came as {bytes} bytes with CRC32C {crc32c:08x}, not as the sample table lists them")]
    Corrupt { samples: usize, bytes: u64, crc32c: u32 },
    #[error("the node cache cannot keep them: {0}")]
    NodeCache(std::io::Error),
    #[error("the task filing them failed: {0}")]
    Task(tokio::task::JoinError),
}

/// Fetches the samples `ids` in one request, checks them, and files each. A failed request is made again
/// (backoff from 200 ms, doubling to 2 s) at least [`ATTEMPTS`] times and while `timeout` from the first
/// lasts (a server restarted meanwhile is waited for, as a mount's reads wait); a refusal (`4xx`) is final.
async fn fetch_group(
    client: &DynClient,
    cache: &Arc<NodeCache>,
    table: &SampleTable,
    ids: &[u32],
    timeout: Duration,
) -> Result<u64, WarmError> {
    let pieces: Vec<Key> = ids.iter().map(|&i| key_of(table, i)).collect();
    let total = pieces.iter().map(|k| k.sent).fold(Sent { bytes: 0, crc32c: 0 }, |acc, p| Sent {
        bytes: acc.bytes + p.bytes,
        crc32c: batchfs::crc::combine(acc.crc32c, p.crc32c, p.bytes),
    });
    let request = Request::Samples(ids.into());
    let (started, mut last) = (std::time::Instant::now(), None);
    for attempt in 0.. {
        if attempt > 0 {
            let backoff = Duration::from_millis(100 << attempt.min(5)).min(Duration::from_secs(2));
            if attempt >= ATTEMPTS && started.elapsed() + backoff >= timeout {
                break;
            }
            tokio::time::sleep(backoff).await;
        }
        let into = Sink::Buffer(Filling::new(Vec::new(), (total.bytes, total.crc32c), None, || {}));
        let body = match client.fetch_body(&request, attempt, into, total).await {
            Ok(body) => body,
            Err(e) if !e.is_retryable() => return Err(WarmError::Client(e)),
            Err(e) => {
                last = Some(WarmError::Client(e));
                continue;
            }
        };
        let Sink::Buffer(filled) = body.sink else { unreachable!("fetched into a buffer") };
        let bytes = filled.finish();
        if bytes.len() as u64 != total.bytes || body.crc32c != total.crc32c {
            last = Some(WarmError::Corrupt { samples: ids.len(), bytes: bytes.len() as u64, crc32c: body.crc32c });
            continue;
        }
        let cache = cache.clone();
        let filed = tokio::task::spawn_blocking(move || {
            let mut at = 0usize;
            for p in pieces {
                let end = at + p.sent.bytes as usize;
                cache.put(p, &bytes[at..end])?;
                at = end;
            }
            Ok::<_, std::io::Error>(())
        })
        .await;
        return match filed {
            Ok(Ok(())) => Ok(total.bytes),
            Ok(Err(e)) => Err(WarmError::NodeCache(e)),
            Err(e) => Err(WarmError::Task(e)),
        };
    }
    Err(last.expect("an attempt failed"))
}
