//! The server over real HTTP/2: every batch of an epoch decodes to exactly the source samples in plan
//! order, manifests match bodies, ranges, every documented error, TLS with ALPN, HTTP/1.1, metrics and
//! graceful shutdown.

use crate::common::{self, expected_samples, fixture, h2c, serve, Expected, ServeWith};
use batchfs::api::{self, BatchQuery, DatasetInfo, DatasetList, ErrorBody, Manifest};
use batchfs::encode::{tar_member_name, tar_sample_key, BatchFormat};
use batchfs::index::SourceFormat;
use batchfs::plan::{EpochPlan, PlanOptions, Shuffle};
use batchfs::proto::{self, FeatureValue};
use batchfs::{crc, tar, tfrecord};
use batchfs_server::config::ServerLimits;
use batchfs_server::storage::{IoMode, Resident};
use reqwest::StatusCode;
use serde_json::Value;

async fn get(client: &reqwest::Client, url: &str) -> reqwest::Response {
    client.get(url).send().await.unwrap()
}

/// Checks that a TFRecord batch body holds exactly `samples`, in order.
fn check_tfrecord(body: &[u8], samples: &[&Expected], source: SourceFormat) {
    let records: Vec<_> = tfrecord::Scanner::new(body, true).collect::<Result<_, _>>().unwrap();
    assert_eq!(records.len(), samples.len());
    for (rec, want) in records.iter().zip(samples) {
        let data = &body[rec.data_offset() as usize..(rec.data_offset() + rec.len) as usize];
        if source == SourceFormat::Tfrecord {
            assert_eq!(data, &want.parts[0].1[..], "passthrough record {}", want.key);
            continue;
        }
        let bytes = |name: &str| proto::example_feature(data, name).unwrap();
        assert_eq!(bytes("key"), Some(FeatureValue::Bytes(vec![want.key.as_bytes()])));
        assert_eq!(bytes("label"), Some(FeatureValue::Int64(vec![want.label])));
        if want.parts.len() == 1 {
            assert_eq!(bytes("data"), Some(FeatureValue::Bytes(vec![&want.parts[0].1[..]])));
        } else {
            for (ext, b) in &want.parts {
                assert_eq!(bytes(&format!("data/{ext}")), Some(FeatureValue::Bytes(vec![&b[..]])), "{}", want.key);
            }
        }
    }
}

/// The members a tar batch of `samples` (with these sample ids) holds: name and bytes.
fn tar_members<'a>(samples: &[&'a Expected], ids: &[u32]) -> Vec<(String, &'a [u8])> {
    let named = samples.iter().zip(ids).map(|(s, &id)| (tar_sample_key(&s.key, id), *s));
    named.flat_map(|(key, s)| s.parts.iter().map(move |(e, b)| (tar_member_name(&key, e), &b[..]))).collect()
}

/// Checks that a tar batch body holds exactly the parts of `samples` (with these sample ids), in order.
fn check_tar(body: &[u8], samples: &[&Expected], ids: &[u32]) {
    let members: Vec<_> = tar::Scanner::new(body).collect::<Result<_, _>>().unwrap();
    let expected = tar_members(samples, ids);
    assert_eq!(members.len(), expected.len());
    for (m, (name, bytes)) in members.iter().zip(expected) {
        assert_eq!(m.name, name);
        assert_eq!(&body[m.data_offset as usize..(m.data_offset + m.size) as usize], bytes, "{name}");
    }
}

/// What the Python readers must see in a batch.
fn check_with_python(
    dir: &std::path::Path,
    body: &[u8],
    idx: Option<&[u8]>,
    samples: &[&Expected],
    ids: &[u32],
    source: SourceFormat,
) {
    let crc_of = |b: &[u8]| Value::from(crc::crc32c(b));
    match idx {
        Some(idx) => {
            let (path, idx_path) = (dir.join("b.tfrecord"), dir.join("b.tfrecord.idx"));
            std::fs::write(&path, body).unwrap();
            std::fs::write(&idx_path, idx).unwrap();
            let Some(seen) = common::python_read(&["tfrecord", path.to_str().unwrap(), idx_path.to_str().unwrap()])
            else {
                return;
            };
            assert_eq!(seen["frames"], samples.len());
            assert_eq!(seen["same_index"], true, "our .idx differs from tfrecord2idx's");
            for (rec, want) in seen["records"].as_array().unwrap().iter().zip(samples) {
                if source == SourceFormat::Tfrecord {
                    assert_eq!(rec["image/class/label"], serde_json::json!([want.label]));
                    continue;
                }
                assert_eq!(rec["key"], crc_of(want.key.as_bytes()));
                assert_eq!(rec["label"], serde_json::json!([want.label]));
                if want.parts.len() == 1 {
                    assert_eq!(rec["data"], crc_of(&want.parts[0].1));
                }
            }
        }
        None => {
            let path = dir.join("b.tar");
            std::fs::write(&path, body).unwrap();
            let Some(seen) = common::python_read(&["tar", path.to_str().unwrap()]) else { return };
            let members: Vec<Value> = tar_members(samples, ids)
                .into_iter()
                .map(|(name, b)| serde_json::json!([name, crc::crc32c(b)]))
                .collect();
            assert_eq!(seen["members"], Value::from(members), "tarfile");
            let wds: Vec<Value> = samples
                .iter()
                .zip(ids)
                .map(|(s, &id)| {
                    let mut m = serde_json::Map::new();
                    m.insert("__key__".into(), tar_sample_key(&s.key, id).into());
                    for (e, b) in &s.parts {
                        m.insert(e.clone(), crc::crc32c(b).into());
                    }
                    Value::Object(m)
                })
                .collect();
            assert_eq!(seen["samples"], Value::from(wds), "webdataset");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_batch_decodes_to_the_source_samples_in_plan_order() {
    let fixtures: Vec<_> = SourceFormat::ALL.iter().map(|&f| (f, fixture(f, 45, 1500))).collect();
    let datasets: Vec<(&str, &std::path::Path)> =
        fixtures.iter().map(|(f, fx)| (f.as_str(), fx.path.as_path())).collect();
    let server = serve(&datasets, ServeWith::default()).await;
    let client = h2c();
    let scratch = tempfile::tempdir().unwrap();
    let plans = [
        (3, PlanOptions { batch_size: 7, seed: 5, shuffle: Shuffle::Global, drop_last: false, block_bytes: 0 }),
        (0, PlanOptions { batch_size: 10, seed: 0, shuffle: Shuffle::None, drop_last: true, block_bytes: 0 }),
    ];
    for (format, fx) in &fixtures {
        let expected = expected_samples(fx);
        let info: DatasetInfo =
            get(&client, &format!("{}{}", server.base, api::dataset_path(format.as_str()))).await.json().await.unwrap();
        assert_eq!((info.format, info.samples), (*format, 45));
        for (epoch, plan_options) in plans {
            let plan = EpochPlan::new(45, epoch, plan_options).unwrap();
            for batch_format in [BatchFormat::Tfrecord, BatchFormat::Tar] {
                let query = BatchQuery { plan: plan_options, format: batch_format };
                let url = format!("{}{}?{}", server.base, api::manifest_path(format.as_str(), epoch), query.to_query());
                let manifest: Manifest = get(&client, &url).await.json().await.unwrap();
                assert_eq!(manifest.batches.len() as u64, plan.batches());
                assert_eq!(manifest.samples, plan.order().len() as u64);
                for entry in &manifest.batches {
                    let path = api::batch_path(format.as_str(), epoch, entry.index);
                    let response = get(&client, &format!("{}{path}?{}", server.base, query.to_query())).await;
                    assert_eq!(response.status(), StatusCode::OK);
                    assert_eq!(response.version(), reqwest::Version::HTTP_2);
                    let header = |n: &str| response.headers()[n].to_str().unwrap().to_owned();
                    assert_eq!(header(api::CRC32C_HEADER), format!("{:08x}", entry.crc32c));
                    assert_eq!(header("etag"), api::etag(entry.crc32c, entry.bytes));
                    assert_eq!(header("content-length"), entry.bytes.to_string());
                    let checkpoints = api::parse_checkpoints(&header(api::CHECKPOINTS_HEADER)).unwrap();
                    let body = response.bytes().await.unwrap();
                    assert_eq!(body.len() as u64, entry.bytes, "{format} batch {}", entry.index);
                    assert_eq!(crc::crc32c(&body), entry.crc32c);
                    assert_eq!(checkpoints, [(entry.bytes, entry.crc32c)], "small batches: only the whole");
                    let ids = plan.batch(entry.index).unwrap();
                    let want: Vec<&Expected> = ids.iter().map(|&i| &expected[i as usize]).collect();
                    assert_eq!(entry.samples as usize, want.len());
                    match batch_format {
                        BatchFormat::Tfrecord => check_tfrecord(&body, &want, *format),
                        _ => check_tar(&body, &want, ids),
                    }
                    if entry.index == 0 {
                        let idx = match batch_format {
                            BatchFormat::Tfrecord => {
                                let q = BatchQuery { format: BatchFormat::TfrecordIdx, ..query };
                                let url = format!("{}{path}?{}", server.base, q.to_query());
                                Some(get(&client, &url).await.bytes().await.unwrap().to_vec())
                            }
                            _ => None,
                        };
                        check_with_python(scratch.path(), &body, idx.as_deref(), &want, ids, *format);
                    }
                }
            }
        }
    }
    server.running.shutdown().await;
}

/// Files of one class whose names differ only after a dot (`cat/a.jpg` and `cat/a.png`, both keyed `cat/a`;
/// `img.1.jpg` and `img_1.jpg`, alike once made safe) are four samples, and WebDataset reading a tar batch
/// of them finds four, each with its own file: not `cat/a` as one sample with both images, nor a
/// "duplicate file name" error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webdataset_finds_every_sample_of_a_tar_batch_whose_keys_are_alike() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("cat")).unwrap();
    let files: [(&str, &[u8]); 4] =
        [("a.jpg", b"jpeg bytes"), ("a.png", b"png bytes"), ("img.1.jpg", b"first"), ("img_1.jpg", b"second")];
    for (name, bytes) in files {
        std::fs::write(dir.path().join("cat").join(name), bytes).unwrap();
    }
    let server = serve(&[("d", dir.path())], ServeWith::default()).await;
    let plan = PlanOptions { batch_size: 8, shuffle: Shuffle::None, ..Default::default() };
    let query = BatchQuery { plan, format: BatchFormat::Tar };
    let url = format!("{}{}?{}", server.base, api::batch_path("d", 0, 0), query.to_query());
    let body = get(&h2c(), &url).await.bytes().await.unwrap();
    server.running.shutdown().await;
    let path = dir.path().join("batch.tar");
    std::fs::write(&path, &body).unwrap();
    let Some(seen) = common::python_read(&["tar", path.to_str().unwrap()]) else { return };
    // In index order (sorted paths), each under its key made safe and its sample id.
    let want = serde_json::json!([
        {"__key__": "cat/a_0", "jpg": crc::crc32c(b"jpeg bytes")},
        {"__key__": "cat/a_1", "png": crc::crc32c(b"png bytes")},
        {"__key__": "cat/img_1_2", "jpg": crc::crc32c(b"first")},
        {"__key__": "cat/img_1_3", "jpg": crc::crc32c(b"second")},
    ]);
    assert_eq!(seen["samples"], want);
}

/// A whole batch body comes with checkpoints: the CRC32C of its first bytes at a few points at least
/// 256 KiB apart, ending with the manifest's size and CRC32C. A range does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_bodies_carry_the_crcs_of_their_prefixes() {
    let fx = fixture(SourceFormat::Tar, 24, 100_000);
    let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let client = h2c();
    for format in [BatchFormat::Tfrecord, BatchFormat::Tar, BatchFormat::TfrecordSlots] {
        let query = BatchQuery { plan: PlanOptions { batch_size: 12, ..Default::default() }, format };
        let url = format!("{}{}?{}", server.base, api::manifest_path("d", 0), query.to_query());
        let manifest: Manifest = get(&client, &url).await.json().await.unwrap();
        for entry in &manifest.batches {
            let url = format!("{}{}?{}", server.base, api::batch_path("d", 0, entry.index), query.to_query());
            let r = get(&client, &url).await;
            let value = r.headers()[api::CHECKPOINTS_HEADER].to_str().unwrap().to_owned();
            let checkpoints = api::parse_checkpoints(&value).unwrap();
            let body = r.bytes().await.unwrap();
            assert!(checkpoints.len() >= 3, "{format}: {checkpoints:?} for {} bytes", body.len());
            assert_eq!(checkpoints.last(), Some(&(entry.bytes, entry.crc32c)));
            let mut last = 0;
            for &(end, crc) in &checkpoints {
                assert_eq!(crc::crc32c(&body[..end as usize]), crc, "{format}: the first {end} bytes");
                assert!(end == entry.bytes || end >= last + batchfs::encode::CHECKPOINT_BYTES);
                last = end;
            }
            let r = client.get(&url).header("range", "bytes=10-99").send().await.unwrap();
            assert_eq!(r.status(), StatusCode::PARTIAL_CONTENT);
            assert!(r.headers().get(api::CHECKPOINTS_HEADER).is_none(), "a range has none");
        }
    }
    server.running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_and_conditional_requests() {
    let fx = fixture(SourceFormat::Files, 20, 3000);
    let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let client = h2c();
    let url = format!("{}{}?batch_size=8", server.base, api::batch_path("d", 1, 0));
    let full = get(&client, &url).await.bytes().await.unwrap();
    let len = full.len();
    let ranged = |range: String| {
        let client = client.clone();
        let url = url.clone();
        async move { client.get(&url).header("range", range).send().await.unwrap() }
    };
    let r = ranged("bytes=10-99".into()).await;
    assert_eq!(r.status(), StatusCode::PARTIAL_CONTENT);
    assert_eq!(r.headers()["content-range"], format!("bytes 10-99/{len}").as_str());
    assert_eq!(r.bytes().await.unwrap(), full[10..100]);
    let r = ranged(format!("bytes={}-", len - 700)).await;
    assert_eq!(r.bytes().await.unwrap(), full[len - 700..]);
    let r = ranged("bytes=-1000".into()).await;
    assert_eq!(r.bytes().await.unwrap(), full[len - 1000..]);
    // Every 4 KiB window of the body, across segment boundaries.
    for start in (0..len).step_by(4093) {
        let end = (start + 4096).min(len);
        let r = ranged(format!("bytes={start}-{}", end - 1)).await;
        assert_eq!(r.bytes().await.unwrap(), full[start..end], "range at {start}");
    }
    let r = ranged(format!("bytes={len}-")).await;
    assert_eq!(r.status(), StatusCode::RANGE_NOT_SATISFIABLE);
    assert_eq!(r.headers()["content-range"], format!("bytes */{len}").as_str());
    // Conditional: the ETag matches, nothing is sent.
    let etag = get(&client, &url).await.headers()["etag"].clone();
    let r = client.get(&url).header("if-none-match", etag.clone()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
    // Compared weakly (RFC 9110), in a list: a cache's `W/` copy of it is the same validator.
    let weak = format!("\"other\", W/{}", etag.to_str().unwrap());
    let r = client.get(&url).header("if-none-match", weak).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
    // If-Range with a stale validator: the whole body.
    let r = client.get(&url).header("range", "bytes=0-9").header("if-range", "\"stale\"").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.bytes().await.unwrap().len(), len);
    // HEAD: headers only.
    let r = client.head(&url).send().await.unwrap();
    assert_eq!(r.headers()["content-length"], len.to_string().as_str());
    assert!(r.bytes().await.unwrap().is_empty());
    server.running.shutdown().await;
}

/// Read with positioned reads or direct reads instead of mapped (`io=pread`, `io=direct`, or a file tree
/// of more shards than `max_mapped_shards`), a dataset serves exactly what the mapping server sends:
/// every batch, every range of one, every source file; with small chunks, so that files are split across
/// chunks and several are read in one (direct: in aligned blocks, through io_uring). A file cut short
/// under the server fails the body; no wrong byte is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positioned_reads_serve_the_same_bytes_as_mappings() {
    let small_chunks = ServerLimits { chunk_size: 5000, ..ServerLimits::default() };
    let many_files = ServerLimits { max_mapped_shards: 1, ..small_chunks.clone() };
    let pread = ServerLimits { io: IoMode::Pread, ..small_chunks.clone() };
    let direct = ServerLimits { io: IoMode::Direct, resident: Resident::Bytes(0), ..small_chunks };
    // Some shards held in the server's memory, the others read directly: batches mix the two.
    let partly = ServerLimits { resident: Resident::Bytes(6000), ..direct.clone() };
    let cases = [
        (SourceFormat::Files, many_files),
        (SourceFormat::Tfrecord, pread),
        (SourceFormat::Tfrecord, direct.clone()),
        (SourceFormat::Files, direct),
        (SourceFormat::Files, partly),
    ];
    for (format, limits) in cases {
        // Each case cuts a file short at its end: a fixture of its own.
        same_bytes(&fixture(format, 60, 3000), limits).await;
    }
}

async fn same_bytes(fx: &common::Fixture, limits: ServerLimits) {
    let mapped = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let (io, resident) = (limits.io, limits.resident);
    let pread = serve(&[("d", &fx.path)], ServeWith { limits: Some(limits), ..ServeWith::default() }).await;
    let client = h2c();
    // The dataset says how it is read, and what of it the server holds in memory (never past `resident`).
    let info: DatasetInfo =
        get(&client, &format!("{}{}", pread.base, api::dataset_path("d"))).await.json().await.unwrap();
    if io == IoMode::Direct {
        assert_eq!(info.io, "direct");
        let Resident::Bytes(room) = resident else { unreachable!("the cases set it") };
        assert!(info.resident_bytes <= room && (info.resident_bytes > 0) == (room > 0), "{info:?}");
    }
    for query in ["batch_size=8", "batch_size=8&format=tar", "batch_size=7&format=tfrecord.idx"] {
        let url = |base: &str| format!("{base}{}?{query}", api::manifest_path("d", 1));
        let manifest: Manifest = get(&client, &url(&mapped.base)).await.json().await.unwrap();
        let other: Manifest = get(&client, &url(&pread.base)).await.json().await.unwrap();
        assert_eq!(manifest, other);
        for entry in &manifest.batches {
            let path = format!("{}?{query}", api::batch_path("d", 1, entry.index));
            let want = get(&client, &format!("{}{path}", mapped.base)).await.bytes().await.unwrap();
            let got = get(&client, &format!("{}{path}", pread.base)).await.bytes().await.unwrap();
            assert_eq!(got, want, "{query} batch {}", entry.index);
            assert_eq!(crc::crc32c(&got), entry.crc32c);
            if entry.index == 0 {
                for start in (0..got.len()).step_by(2999) {
                    let end = (start + 4096).min(got.len());
                    let r = client
                        .get(format!("{}{path}", pread.base))
                        .header("range", format!("bytes={start}-{}", end - 1))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.bytes().await.unwrap(), want[start..end], "{query} range at {start}");
                }
            }
        }
    }
    let files = common::all_files(&client, &pread.base, "d").await;
    assert!(files.len() >= 4, "{files:?}");
    for f in &files {
        let url = |server: &common::Server| format!("{}{}", server.base, api::file_path("d", &f.path));
        let body = get(&client, &url(&pread)).await.bytes().await.unwrap();
        assert_eq!(body, get(&client, &url(&mapped)).await.bytes().await.unwrap());
        match std::fs::read(fx.path.join(&f.path)) {
            Ok(on_disk) => assert_eq!(body, on_disk),
            // A TFRecord shard's DALI index twin, made from the index.
            Err(_) => assert!(f.path.ends_with(".tfrecord.idx") && body.ends_with(b"\n"), "{}", f.path),
        }
    }
    let metrics = get(&client, &format!("{}/metrics", pread.base)).await.text().await.unwrap();
    let blocking = |l: &str| l.starts_with("batchfs_storage_blocking_reads_total") && !l.ends_with(" 0");
    assert!(metrics.lines().any(blocking), "{metrics}");
    // A body holding all samples fails when a source file is cut short under the server. (The mapping
    // server stops first: a mapped shard cut short would fault it.) The last file: the first ones may be
    // held in memory (`resident`), read before the cut.
    mapped.running.shutdown().await;
    let first = files.iter().rev().map(|f| fx.path.join(&f.path)).find(|p| p.exists()).unwrap();
    let len = std::fs::metadata(&first).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&first).unwrap().set_len(len / 2).unwrap();
    let url = format!("{}{}?batch_size=60", pread.base, api::batch_path("d", 0, 0));
    let result = async { client.get(&url).send().await?.error_for_status()?.bytes().await }.await;
    assert!(result.is_err(), "a body with a truncated file must fail, not arrive");
    pread.running.shutdown().await;
}

/// With `sendfile`, the bytes of mapped shards go out from their files: every batch (TFRecord and tar,
/// samples of 40 KB: each past the size sent from the file), ranges of one, and every source file (whole
/// shards) are the bytes a copying server sends, the metric says the file sent them, and a shard cut short
/// under the server fails the body: no wrong byte arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sendfile_sends_the_bytes_a_copying_server_sends() {
    let fx = fixture(SourceFormat::Tfrecord, 48, 40_000);
    let copying = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let limits = ServerLimits { sendfile: true, io: IoMode::Mmap, ..ServerLimits::default() };
    let sending = serve(&[("d", &fx.path)], ServeWith { limits: Some(limits), ..ServeWith::default() }).await;
    let client = h2c();
    let sent_from_files = |server: &common::Server| {
        let (client, url) = (client.clone(), format!("{}/metrics", server.base));
        async move {
            let text = get(&client, &url).await.text().await.unwrap();
            let line = text.lines().find(|l| l.starts_with("batchfs_sendfile_bytes_total ")).unwrap().to_owned();
            line.rsplit(' ').next().unwrap().parse::<u64>().unwrap()
        }
    };
    for query in ["batch_size=8", "batch_size=8&format=tar"] {
        let manifest: Manifest = get(&client, &format!("{}{}?{query}", sending.base, api::manifest_path("d", 2)))
            .await
            .json()
            .await
            .unwrap();
        for entry in &manifest.batches {
            let path = format!("{}?{query}", api::batch_path("d", 2, entry.index));
            let want = get(&client, &format!("{}{path}", copying.base)).await.bytes().await.unwrap();
            let got = get(&client, &format!("{}{path}", sending.base)).await.bytes().await.unwrap();
            assert_eq!(got, want, "{query} batch {}", entry.index);
            assert_eq!(crc::crc32c(&got), entry.crc32c);
            if entry.index == 1 {
                for start in (0..got.len()).step_by(70_001) {
                    let end = (start + 100_000).min(got.len());
                    let r = client
                        .get(format!("{}{path}", sending.base))
                        .header("range", format!("bytes={start}-{}", end - 1))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.bytes().await.unwrap(), want[start..end], "{query} range at {start}");
                }
            }
        }
    }
    let files = common::all_files(&client, &sending.base, "d").await;
    for f in files.iter().filter(|f| f.path.ends_with(".tfrecord")) {
        let url = format!("{}{}", sending.base, api::file_path("d", &f.path));
        assert_eq!(get(&client, &url).await.bytes().await.unwrap(), std::fs::read(fx.path.join(&f.path)).unwrap());
    }
    let sent = sent_from_files(&sending).await;
    let total: u64 = std::fs::read_dir(&fx.path).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    assert!(sent > total, "only {sent} bytes were sent from files, of more than {total} sent");
    assert_eq!(sent_from_files(&copying).await, 0);
    copying.running.shutdown().await;
    // A shard cut short: the whole epoch's batch holds samples of every shard.
    let shard = files.iter().find(|f| f.path.ends_with(".tfrecord")).unwrap();
    let path = fx.path.join(&shard.path);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    let url = format!("{}{}?batch_size=48", sending.base, api::batch_path("d", 0, 0));
    let result = async { client.get(&url).send().await?.error_for_status()?.bytes().await }.await;
    assert!(result.is_err(), "a body with a truncated shard must fail, not arrive");
    sending.running.shutdown().await;
}

/// A server answers while it indexes: `/healthz` is 503 with `Retry-After` and says which datasets are
/// ready and how far the others are; a dataset not ready yet gets 503 with `Retry-After`, a ready one is
/// served; once the last is inserted, `/healthz` is 200 and every dataset is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_answers_while_datasets_are_indexed() {
    use batchfs::source::{IndexOptions, NoProgress};
    use batchfs_server::catalog::{Catalog, Dataset};
    let (ready, later) = (fixture(SourceFormat::Tar, 20, 1000), fixture(SourceFormat::Files, 20, 1000));
    let open = |name: &str, fx: &common::Fixture| {
        Dataset::open(name, &fx.path, None, &IndexOptions::default(), &NoProgress, ServerLimits::default().io_policy())
            .unwrap()
    };
    let catalog = std::sync::Arc::new(Catalog::default());
    catalog.insert(open("ready", &ready)).unwrap();
    catalog.announce("later").unwrap();
    assert!(catalog.announce("later").is_err(), "announced twice");
    catalog.progress("later", 50, 200);
    let options = batchfs_server::ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: None,
        token: None,
        limits: ServerLimits::default(),
    };
    let running = batchfs_server::start(catalog.clone(), options).await.unwrap();
    let base = format!("http://127.0.0.1:{}", running.local_addr().port());
    let client = h2c();
    let r = get(&client, &format!("{base}/healthz")).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()["retry-after"], "5");
    let text = r.text().await.unwrap();
    assert_eq!(text, "indexing\nready ready\nlater indexing 25 %\n");
    let r = get(&client, &format!("{base}{}", api::dataset_path("later"))).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()["retry-after"], "5");
    assert!(r.json::<ErrorBody>().await.unwrap().error.contains("still being indexed (25 %)"));
    let r = get(&client, &format!("{base}{}?batch_size=4", api::batch_path("later", 0, 0))).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let list: DatasetList = get(&client, &format!("{base}/v1/datasets")).await.json().await.unwrap();
    assert_eq!(list.datasets.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["ready"]);
    let r = get(&client, &format!("{base}{}?batch_size=4", api::batch_path("ready", 0, 0))).await;
    assert_eq!(r.status(), StatusCode::OK);
    let unknown = get(&client, &format!("{base}{}", api::dataset_path("nope"))).await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    assert!(unknown.text().await.unwrap().contains(r#"[\"later\", \"ready\"]"#), "names every dataset");

    catalog.insert(open("later", &later)).unwrap();
    let r = get(&client, &format!("{base}/healthz")).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.text().await.unwrap(), "ok\n");
    let r = get(&client, &format!("{base}{}?batch_size=4", api::batch_path("later", 0, 0))).await;
    assert_eq!(r.status(), StatusCode::OK);
    running.shutdown().await;
}

/// Saturated (`max_bodies_in_flight` bodies being sent), the server answers batch and file requests 503
/// with `Retry-After` at once instead of queueing them; manifests and health still answer; a body that
/// finishes makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_server_answers_503_at_once() {
    let fx = fixture(SourceFormat::Tfrecord, 40, 120_000);
    let limits = ServerLimits { max_bodies_in_flight: 1, readahead_batches: 0, ..ServerLimits::default() };
    let server = serve(&[("d", &fx.path)], ServeWith { limits: Some(limits), ..ServeWith::default() }).await;
    // With 64 KiB HTTP/2 windows a 2.4 MB body its client does not read stays in flight (one of at most
    // `chunk_size`, 1 MiB, is handed to HTTP/2 whole, and waits in its buffer, no longer in flight).
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .http2_initial_stream_window_size(65_535)
        .http2_initial_connection_window_size(64 << 20)
        .build()
        .unwrap();
    let url = |b: u64| format!("{}{}?batch_size=20", server.base, api::batch_path("d", 0, b));
    let listed = format!("{}{}?batch_size=20", server.base, api::manifest_path("d", 0));
    assert_eq!(client.get(&listed).send().await.unwrap().bytes().await.unwrap()[0], b'{');
    let held = client.get(url(0)).send().await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let started = std::time::Instant::now();
    let refused = client.get(url(1)).send().await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert!(refused.json::<ErrorBody>().await.unwrap().error.contains("saturated"));
    assert!(started.elapsed() < std::time::Duration::from_secs(2), "answered at once");
    let file = format!("{}{}", server.base, api::file_path("d", "train-00000-of-00016.tfrecord"));
    assert_eq!(client.get(&file).send().await.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    // A manifest cached is answered still (one buffer however many ask: a mount's next epoch's, computed
    // ahead); one not cached is refused as a body is.
    let manifest = |e: u64| format!("{}{}?batch_size=20", server.base, api::manifest_path("d", e));
    assert_eq!(client.get(manifest(0)).send().await.unwrap().status(), StatusCode::OK);
    assert_eq!(client.get(manifest(7)).send().await.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(client.get(format!("{}/healthz", server.base)).send().await.unwrap().status(), StatusCode::OK);
    // The held body finishes: room again.
    assert!(held.bytes().await.unwrap().len() > 2_000_000);
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..50 {
        status = client.get(url(1)).send().await.unwrap().status();
        if status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(status, StatusCode::OK);
    server.running.shutdown().await;
}

/// A client that stops reading its bodies (its HTTP/2 windows shut) while its stack still answers the
/// server's keep-alive PINGs is closed once `idle_timeout` passes with no body moving, and the places its
/// bodies held in `max_bodies_in_flight` are free again: the PINGs kept it open for good, and every other
/// client's batch request was answered 503. A connection whose body is read, slowly, stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_closed_after_idle_timeout() {
    let fx = fixture(SourceFormat::Tfrecord, 40, 120_000);
    let limits = ServerLimits {
        max_bodies_in_flight: 1,
        readahead_batches: 0,
        idle_timeout: std::time::Duration::from_secs(2),
        keep_alive_interval: std::time::Duration::from_millis(300),
        // The wait on the server a stream may be in before its connection is dropped.
        request_timeout: std::time::Duration::from_secs(1),
        object_retry_for: std::time::Duration::from_secs(1),
        ..ServerLimits::default()
    };
    let server = serve(&[("d", &fx.path)], ServeWith { limits: Some(limits), ..ServeWith::default() }).await;
    let small_windows = || {
        let builder = reqwest::Client::builder().http2_prior_knowledge();
        builder.http2_initial_stream_window_size(65_535).http2_initial_connection_window_size(64 << 20).build()
    };
    let url = |b: u64| format!("{}{}?batch_size=20", server.base, api::batch_path("d", 0, b));
    let stuck = small_windows().unwrap();
    let held = stuck.get(url(0)).send().await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let other = h2c();
    assert_eq!(other.get(url(1)).send().await.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    // Read slowly, a frame at a time: never idle, never closed.
    let slow = small_windows().unwrap();
    let started = std::time::Instant::now();
    let mut read = slow.get(url(1)).send().await.unwrap();
    while read.status() != StatusCode::OK && started.elapsed() < std::time::Duration::from_secs(20) {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        read = slow.get(url(1)).send().await.unwrap();
    }
    assert_eq!(read.status(), StatusCode::OK, "the stuck client's body was let go");
    assert!(started.elapsed() >= std::time::Duration::from_secs(1), "not before idle_timeout");
    let (whole, mut got) = (read.content_length(), 0);
    while let Some(chunk) =
        read.chunk().await.unwrap_or_else(|e| panic!("after {got} bytes, {:?}: {e}", started.elapsed()))
    {
        got += chunk.len();
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    }
    assert!(got > 1_000_000 && Some(got as u64) == whole, "a slow reader's body completes: {got} of {whole:?}");
    // The stuck client's body was cut, not completed.
    assert!(held.bytes().await.is_err());
    drop(stuck);
    server.running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_files_are_served_and_cannot_escape() {
    let tree = fixture(SourceFormat::Files, 12, 2000);
    let shards = fixture(SourceFormat::Tar, 12, 2000);
    let server = serve(&[("tree", &tree.path), ("wds", &shards.path)], ServeWith::default()).await;
    let client = h2c();
    for s in expected_samples(&tree) {
        let rel = format!("{}.jpg", s.key);
        let r = get(&client, &format!("{}{}", server.base, api::file_path("tree", &rel))).await;
        assert_eq!(r.status(), StatusCode::OK, "{rel}");
        assert_eq!(r.headers()[api::CRC32C_HEADER], format!("{:08x}", crc::crc32c(&s.parts[0].1)).as_str());
        assert_eq!(r.bytes().await.unwrap(), s.parts[0].1);
    }
    let list: api::FileList =
        get(&client, &format!("{}{}", server.base, api::files_path("wds"))).await.json().await.unwrap();
    assert_eq!(list.files.len(), 4);
    for f in &list.files {
        let bytes = std::fs::read(shards.path.join(&f.path)).unwrap();
        assert_eq!((f.size, f.crc32c), (bytes.len() as u64, crc::crc32c(&bytes)), "{}", f.path);
    }
    let on_disk = std::fs::read(shards.path.join("shard-000001.tar")).unwrap();
    let url = format!("{}{}", server.base, api::file_path("wds", "shard-000001.tar"));
    assert_eq!(get(&client, &url).await.bytes().await.unwrap(), on_disk);
    let r = client.get(&url).header("range", "bytes=512-1023").send().await.unwrap();
    assert_eq!(r.bytes().await.unwrap(), on_disk[512..1024]);
    for escape in
        ["../wds/shard-000001.tar", "%2E%2E/%2E%2E/etc/passwd", "/etc/passwd", ".batchfs-index", "nothing.jpg"]
    {
        let r = get(&client, &format!("{}/v1/datasets/tree/files/{escape}", server.base)).await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND, "{escape}");
    }
    // The file tree, one directory and one page at a time: every file exactly once, in path order.
    let mut listed = Vec::new();
    let mut pending = vec![String::new()];
    let mut pages = 0;
    while let Some(dir) = pending.pop() {
        let mut q = api::FilesQuery { dir: dir.clone(), cursor: 0, limit: 2 };
        loop {
            let url = format!("{}{}?{}", server.base, api::files_path("tree"), q.to_query());
            let page: api::FileList = get(&client, &url).await.json().await.unwrap();
            pages += 1;
            assert!(page.dirs.len() + page.files.len() <= 2);
            assert_eq!(page.dir, dir);
            let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
            pending.extend(page.dirs.iter().map(|d| format!("{prefix}{d}")));
            for f in page.files {
                assert!(f.path.strip_prefix(&prefix).is_some_and(|rest| !rest.contains('/')), "{}", f.path);
                listed.push(f.path);
            }
            match page.next {
                Some(next) => q.cursor = next,
                None => break,
            }
        }
    }
    listed.sort();
    let mut want: Vec<String> = expected_samples(&tree).iter().map(|s| format!("{}.jpg", s.key)).collect();
    want.sort();
    assert_eq!(listed, want);
    assert!(pages > 6, "paged: {pages} pages");
    for (query, status) in [("dir=class-0000/..", 400), ("dir=nope", 404), ("dir=class-0000/x.jpg", 404), ("x=1", 400)]
    {
        let r = get(&client, &format!("{}{}?{query}", server.base, api::files_path("tree"))).await;
        assert_eq!(r.status().as_u16(), status, "{query}");
    }
    server.running.shutdown().await;
}

async fn error_of(r: reqwest::Response, status: StatusCode) -> String {
    assert_eq!(r.status(), status);
    assert_eq!(r.headers()["content-type"], "application/json");
    r.json::<ErrorBody>().await.unwrap().error
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_error() {
    let fx = fixture(SourceFormat::Tfrecord, 10, 1000);
    let token_with = ServeWith { token: Some("s3cret".into()), ..Default::default() };
    let server = serve(&[("d", &fx.path)], token_with).await;
    let client = h2c();
    let base = &server.base;
    let authed = |path: &str| client.get(format!("{base}{path}")).bearer_auth("s3cret").send();

    // Health needs no token; everything else does.
    assert_eq!(get(&client, &format!("{base}/healthz")).await.status(), StatusCode::OK);
    let r = get(&client, &format!("{base}/v1/datasets")).await;
    assert_eq!(r.headers()["www-authenticate"], "Bearer realm=\"batchfs\"");
    assert!(error_of(r, StatusCode::UNAUTHORIZED).await.contains("requires a token"));
    let r = client.get(format!("{base}/v1/datasets")).bearer_auth("wrong").send().await.unwrap();
    assert!(error_of(r, StatusCode::UNAUTHORIZED).await.contains("wrong"));
    let list: DatasetList = authed("/v1/datasets").await.unwrap().json().await.unwrap();
    assert_eq!(list.datasets.len(), 1);

    let cases: &[(&str, StatusCode, &str)] = &[
        ("/v1/datasets/nope", StatusCode::NOT_FOUND, "unknown dataset"),
        ("/v1/datasets/nope/epochs/0", StatusCode::NOT_FOUND, "unknown dataset"),
        ("/v1/datasets/d/epochs/0?batch_size=0", StatusCode::BAD_REQUEST, "batch_size"),
        ("/v1/datasets/d/epochs/1000000", StatusCode::BAD_REQUEST, "epoch must be"),
        ("/v1/datasets/d/epochs/x", StatusCode::BAD_REQUEST, "epoch must be"),
        ("/v1/datasets/d/epochs/0/batches/0?format=zip", StatusCode::BAD_REQUEST, "unknown batch format"),
        ("/v1/datasets/d/epochs/0/batches/0?shuffle=local", StatusCode::BAD_REQUEST, "shuffle"),
        ("/v1/datasets/d/epochs/0/batches/0?colour=red", StatusCode::BAD_REQUEST, "unknown query parameter"),
        ("/v1/datasets/d/epochs/0/batches/99", StatusCode::NOT_FOUND, "has 1 batches"),
        ("/v1/datasets/d/files/missing", StatusCode::NOT_FOUND, "no file"),
        ("/v2/anything", StatusCode::NOT_FOUND, "no such path"),
    ];
    for (path, status, needle) in cases {
        let message = error_of(authed(path).await.unwrap(), *status).await;
        assert!(message.contains(needle), "{path}: {message:?} lacks {needle:?}");
    }
    let r = client.post(format!("{base}/v1/datasets")).bearer_auth("s3cret").send().await.unwrap();
    assert_eq!(r.headers()["allow"], "GET, HEAD");
    error_of(r, StatusCode::METHOD_NOT_ALLOWED).await;
    server.running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_negotiates_h2_and_http1_is_served() {
    let fx = fixture(SourceFormat::Lmdb, 10, 1000);
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let tls = batchfs_server::TlsFiles::new(cert_path, key_path);
    let server = serve(&[("d", &fx.path)], ServeWith { tls: Some(tls), ..Default::default() }).await;
    assert!(server.base.starts_with("https://"));
    let root = reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).unwrap();
    let url = format!("{}{}?batch_size=4", server.base, api::batch_path("d", 0, 1));
    let h2 = reqwest::Client::builder().use_rustls_tls().add_root_certificate(root.clone()).build().unwrap();
    let r = h2.get(&url).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2, "ALPN must select h2");
    let crc_header = r.headers()[api::CRC32C_HEADER].to_str().unwrap().to_owned();
    let body = r.bytes().await.unwrap();
    assert_eq!(format!("{:08x}", crc::crc32c(&body)), crc_header);
    let h1 = reqwest::Client::builder().use_rustls_tls().add_root_certificate(root).http1_only().build().unwrap();
    let r = h1.get(&url).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_11);
    assert_eq!(r.bytes().await.unwrap(), body);
    server.running.shutdown().await;

    // Cleartext HTTP/1.1 on an h2c server (curl without --http2-prior-knowledge).
    let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let h1 = reqwest::Client::builder().http1_only().build().unwrap();
    let url = format!("{}{}?batch_size=4", server.base, api::batch_path("d", 0, 1));
    let r = h1.get(&url).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_11);
    assert_eq!(r.bytes().await.unwrap(), body);
    server.running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_in_flight_batches_finish() {
    let fx = fixture(SourceFormat::Tfrecord, 64, 200_000);
    let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let client = h2c();
    let url = format!("{}{}?batch_size=64", server.base, api::batch_path("d", 0, 0));
    let manifest: Manifest = get(&client, &format!("{}{}?batch_size=64", server.base, api::manifest_path("d", 0)))
        .await
        .json()
        .await
        .unwrap();
    let mut response = get(&client, &url).await;
    let mut received = response.chunk().await.unwrap().unwrap().to_vec();
    let addr = server.running.local_addr();
    let stop = server.running.shutdown_handle();
    stop.send(true).unwrap();
    // New connections are refused once the listener is closed...
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "listener still open after shutdown");
    // ...while the batch already in flight completes, byte for byte.
    while let Some(chunk) = response.chunk().await.unwrap() {
        received.extend_from_slice(&chunk);
    }
    assert_eq!(received.len() as u64, manifest.batches[0].bytes);
    assert_eq!(crc::crc32c(&received), manifest.batches[0].crc32c);
    drop(client);
    tokio::time::timeout(std::time::Duration::from_secs(10), server.running.wait()).await.expect("server stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_bytes_and_errors() {
    let fx = fixture(SourceFormat::Tar, 16, 1000);
    let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let client = h2c();
    let url = format!("{}{}?batch_size=4", server.base, api::batch_path("d", 0, 0));
    let body = get(&client, &url).await.bytes().await.unwrap();
    get(&client, &format!("{}/v1/datasets/none", server.base)).await;
    let text = get(&client, &format!("{}/metrics", server.base)).await.text().await.unwrap();
    assert!(text.contains("batchfs_requests_total{kind=\"batch\"} 1"), "{text}");
    assert!(text.contains("batchfs_errors_total{status=\"404\"} 1"), "{text}");
    let sent: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("batchfs_response_bytes_total "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(sent >= body.len() as u64, "{sent} < {}", body.len());
    assert!(text.contains("batchfs_request_latency_seconds_count"));
    server.running.shutdown().await;
}

/// A manifest is computed once however many ask for it at once, and asking for epoch e's computes e + 1's
/// in the background, so the next epoch's request (a job's next `ls`) finds it ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_are_computed_once_and_the_next_epochs_ahead() {
    let fx = fixture(SourceFormat::Tfrecord, 40, 1000);
    let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let client = h2c();
    let computed = || async {
        let text = get(&client, &format!("{}/metrics", server.base)).await.text().await.unwrap();
        let line = text.lines().find_map(|l| l.strip_prefix("batchfs_manifests_computed_total{dataset=\"d\"} "));
        line.expect("the counter is exported").parse::<u64>().unwrap()
    };
    // Settles at `want` (the background computation of the next epoch's takes a moment).
    let settles_at = |want: u64| async move {
        for _ in 0..200 {
            if computed().await == want {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                assert_eq!(computed().await, want, "and stays");
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("manifests computed: {} (want {want})", computed().await);
    };
    let manifest = |epoch: u64| {
        let (client, base) = (client.clone(), server.base.clone());
        async move {
            let url = format!("{base}{}?batch_size=8", api::manifest_path("d", epoch));
            get(&client, &url).await.json::<Manifest>().await.unwrap()
        }
    };
    assert_eq!(computed().await, 0);
    let first = manifest(0).await;
    settles_at(2).await;
    let next = manifest(1).await;
    assert_eq!((first.epoch, next.epoch), (0, 1));
    // Epoch 1's was ready, and asking for it computes epoch 2's.
    settles_at(3).await;
    let tasks: Vec<_> = (0..6).map(|_| tokio::spawn(manifest(7))).collect();
    let mut together = Vec::new();
    for task in tasks {
        together.push(task.await.unwrap());
    }
    assert!(together.iter().all(|m| m == &together[0]));
    // Epoch 7's once, and epoch 8's once.
    settles_at(5).await;
    server.running.shutdown().await;
}

/// `tfrecord.slots`: every record of every batch of every epoch is one slot (`slot_bytes` of the
/// dataset), its TFRecord checks pass, and it decodes to the same sample as the packed record (the
/// padding is a protobuf field parsers skip); its index is the same for every epoch.
#[tokio::test]
async fn slot_batches_hold_the_samples_in_fixed_frames() {
    for source in [SourceFormat::Tfrecord, SourceFormat::Tar] {
        let fx = fixture(source, 40, 3000);
        let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
        let client = h2c();
        let info: DatasetInfo =
            get(&client, &format!("{}{}", server.base, api::dataset_path("d"))).await.json().await.unwrap();
        let slot = info.slot_bytes;
        assert!(slot > info.mean_frame_bytes && info.mean_frame_bytes > 3000, "{info:?}");
        for epoch in 0..2 {
            let q = |format: &str| format!("batch_size=16&seed=1&format={format}");
            let m: Manifest =
                get(&client, &format!("{}{}?{}", server.base, api::manifest_path("d", epoch), q("tfrecord.slots")))
                    .await
                    .json()
                    .await
                    .unwrap();
            for b in &m.batches {
                let url = |format| format!("{}{}?{}", server.base, api::batch_path("d", epoch, b.index), q(format));
                let body = get(&client, &url("tfrecord.slots")).await.bytes().await.unwrap();
                assert_eq!((body.len() as u64, crc::crc32c(&body)), (b.bytes, b.crc32c));
                assert_eq!(body.len() as u64, slot * u64::from(b.samples));
                let packed = get(&client, &url("tfrecord")).await.bytes().await.unwrap();
                let records: Vec<_> = tfrecord::Scanner::new(&body, true).collect::<Result<_, _>>().unwrap();
                let originals: Vec<_> = tfrecord::Scanner::new(&packed, true).collect::<Result<_, _>>().unwrap();
                assert_eq!(records.len(), originals.len());
                for (r, o) in records.iter().zip(&originals) {
                    assert_eq!(r.frame_len(), slot);
                    let data = &body[r.data_offset() as usize..(r.data_offset() + r.len) as usize];
                    let orig = &packed[o.data_offset() as usize..(o.data_offset() + o.len) as usize];
                    assert_eq!(&data[..orig.len()], orig, "the sample's record, then the padding");
                    let key = |d| proto::example_feature(d, "key").unwrap();
                    if source == SourceFormat::Tar {
                        assert_eq!(key(data), key(orig));
                    }
                }
                let idx = get(&client, &url("tfrecord.slots.idx")).await.text().await.unwrap();
                let want: String = (0..u64::from(b.samples)).map(|j| format!("{} {slot}\n", j * slot)).collect();
                assert_eq!(idx, want);
            }
        }
        server.running.shutdown().await;
    }
}

/// The sample table lists every sample's label, size and CRC32C in index order; a data request sends the
/// samples it names, one after another, with their CRC32C; bad ids are refused.
/// Every reply that describes the dataset's layout says the index it was made of, as the description
/// does: a manifest, each page of a listing and a slot table in their JSON, the binary sample table in a
/// header (its bytes stay 16 a sample). Every body (a batch, samples' data, a file's range) and every other
/// reply about the dataset, an error too, says it in its head, where a mount compares it before any byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_reply_that_describes_the_layout_says_its_index_id() {
    let fx = fixture(SourceFormat::Files, 40, 3000);
    let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
    let client = h2c();
    let url = |path: String| format!("{}{path}", server.base);
    let info: DatasetInfo = get(&client, &url(api::dataset_path("d"))).await.json().await.unwrap();
    assert_eq!(info.index_id.len(), 16, "{info:?}");
    let m: Manifest = get(&client, &url(api::manifest_path("d", 0))).await.json().await.unwrap();
    let page = format!("{}?{}", api::files_path("d"), api::FilesQuery { limit: 2, ..Default::default() }.to_query());
    let page: api::FileList = get(&client, &url(page)).await.json().await.unwrap();
    assert!(page.next.is_some(), "one page of several");
    let slots = format!("{}?epochs=2", api::rolling_path("d"));
    let slots: api::SlotTable = get(&client, &url(slots)).await.json().await.unwrap();
    let r = get(&client, &url(api::samples_path("d"))).await;
    let header = r.headers()[api::INDEX_ID_HEADER].to_str().unwrap().to_owned();
    assert_eq!(r.bytes().await.unwrap().len(), 40 * api::SampleTable::RECORD);
    for (reply, id) in [("manifest", &m.index_id), ("listing", &page.index_id), ("slots", &slots.index_id)] {
        assert_eq!(id, &info.index_id, "{reply}");
    }
    assert_eq!(header, info.index_id, "the sample table's header");
    let file = common::all_files(&client, &server.base, "d").await.swap_remove(0).path;
    let heads = [
        (api::batch_path("d", 0, 0), None, StatusCode::OK),
        (format!("{}?{}", api::sample_data_path("d"), api::sample_ids_query(&[3, 1])), None, StatusCode::OK),
        (api::file_path("d", &file), Some("bytes=1-10"), StatusCode::PARTIAL_CONTENT),
        (api::file_path("d", "class-0000/gone.jpg"), None, StatusCode::NOT_FOUND),
        (api::manifest_path("d", 0), None, StatusCode::OK),
        (api::dataset_path("d"), None, StatusCode::OK),
    ];
    for (path, range, status) in heads {
        let mut request = client.get(url(path.clone()));
        if let Some(range) = range {
            request = request.header("range", range);
        }
        let r = request.send().await.unwrap();
        assert_eq!(r.status(), status, "{path}");
        let said = r.headers().get(api::INDEX_ID_HEADER).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(said.as_deref(), Some(info.index_id.as_str()), "{path}: {}", r.status());
    }
    server.running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_table_and_sample_data_are_the_samples() {
    for format in [SourceFormat::Files, SourceFormat::Tfrecord] {
        let fx = fixture(format, 40, 3000);
        let server = serve(&[("d", &fx.path)], ServeWith::default()).await;
        let client = h2c();
        let expected = expected_samples(&fx);
        let r = get(&client, &format!("{}{}", server.base, api::samples_path("d"))).await;
        assert_eq!(r.status(), StatusCode::OK);
        let table = api::SampleTable::decode(&r.bytes().await.unwrap()).unwrap();
        assert_eq!(table.len(), expected.len());
        for (i, want) in expected.iter().enumerate() {
            let data: Vec<u8> = want.parts.iter().flat_map(|p| p.1.clone()).collect();
            assert_eq!((table.bytes[i], table.crc32c[i]), (data.len() as u64, crc::crc32c(&data)), "{format:?} {i}");
            assert_eq!(table.labels[i], u32::try_from(want.label).unwrap_or(api::SampleTable::NO_LABEL));
        }
        let ids = [7u32, 0, 39, 7];
        let url = format!("{}{}?{}", server.base, api::sample_data_path("d"), api::sample_ids_query(&ids));
        let r = get(&client, &url).await;
        assert_eq!(r.status(), StatusCode::OK);
        let crc_header = r.headers()[api::CRC32C_HEADER].to_str().unwrap().to_owned();
        let body = r.bytes().await.unwrap();
        let want: Vec<u8> =
            ids.iter().flat_map(|&i| expected[i as usize].parts.iter().flat_map(|p| p.1.clone())).collect();
        assert_eq!(&body[..], &want[..]);
        assert_eq!(crc_header, format!("{:08x}", crc::crc32c(&want)));
        for bad in ["ids=40", "ids=", "", "ids=1&x=2"] {
            let url = format!("{}{}?{bad}", server.base, api::sample_data_path("d"));
            let msg = error_of(get(&client, &url).await, StatusCode::BAD_REQUEST).await;
            assert!(!msg.is_empty(), "{bad}");
        }
        server.running.shutdown().await;
    }
}
