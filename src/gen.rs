//! Synthetic datasets for tests, demos and benchmarks, written in the real on-disk format of each source
//! kind.
//!
//! Samples look like JPEG images: a JFIF header, incompressible bytes, an end marker. Their sizes have
//! ImageNet's shape by default ([`Sizes::ImageNet`]): most log-normal around the mean (σ = 0.5 in log
//! space, ImageNet's spread around its ~110 KB mean), and a heavy tail, 1 % of them 10–50 times the mean
//! (log-uniform), as the megabyte photographs among ImageNet's training JPEGs are; the overall mean is
//! the requested one. A layout that holds only on tame sizes must fail here. [`Sizes::LogNormal`] keeps
//! the bulk alone (no sample above 8 times the mean). Everything is a pure function of the seed.

use crate::index::SourceFormat;
use crate::mmap::LmdbEnv;
use crate::plan::SplitMix64;
use crate::proto::{self, WrapFeature};
use crate::{tar, tfrecord};
use std::io::{self, BufWriter, Write};
use std::path::Path;
use thiserror::Error;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenOptions {
    pub format: SourceFormat,
    pub samples: u32,
    /// Mean sample size in bytes.
    pub mean_bytes: u64,
    /// Number of shards (TFRecord and tar; LMDB is one environment, a file tree one file per sample).
    pub shards: u32,
    pub classes: u32,
    pub seed: u64,
    /// The distribution of sample sizes.
    pub sizes: Sizes,
}

/// How sample sizes are distributed around [`GenOptions::mean_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sizes {
    /// Log-normal (σ = 0.5) with a heavy tail: 1 % of the samples 10–50 times the mean (log-uniform).
    #[default]
    ImageNet,
    /// Log-normal (σ = 0.5) alone, cut at 8 times the mean.
    LogNormal,
}

impl Sizes {
    /// Name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Sizes::ImageNet => "imagenet",
            Sizes::LogNormal => "lognormal",
        }
    }
}

impl std::str::FromStr for Sizes {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "imagenet" => Ok(Sizes::ImageNet),
            "lognormal" => Ok(Sizes::LogNormal),
            other => Err(format!("unknown size distribution {other:?}: expected imagenet or lognormal")),
        }
    }
}

/// The share of the samples in [`Sizes::ImageNet`]'s tail, and the tail's range in means.
pub const TAIL_SHARE: f64 = 0.01;
pub const TAIL_MEANS: (f64, f64) = (10.0, 50.0);

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions {
            format: SourceFormat::Tfrecord,
            samples: 2000,
            mean_bytes: 110_000,
            shards: 16,
            classes: 10,
            seed: 0,
            sizes: Sizes::default(),
        }
    }
}

/// What was generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenSummary {
    pub samples: u64,
    /// Bytes of sample payload (image bytes).
    pub bytes: u64,
    pub files: u64,
}

/// A generation failure.
#[derive(Debug, Error)]
pub enum GenError {
    #[error("cannot write {path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("cannot write the LMDB environment in {path}: {message}")]
    Lmdb { path: String, message: String },
    #[error("invalid options: {0}")]
    Options(String),
}

/// One generated sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenSample {
    pub key: String,
    pub label: i64,
    pub data: Vec<u8>,
}

/// The deterministic sample `i` of a dataset generated with `options`.
pub fn sample(options: &GenOptions, i: u32) -> GenSample {
    let mut rng = SplitMix64::new(options.seed ^ (u64::from(i) + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let label = rng.below(u64::from(options.classes.max(1))) as i64;
    let mean = options.mean_bytes.max(1) as f64;
    // The tail's mean in means, of a log-uniform draw from `TAIL_MEANS`: (b - a) / ln(b / a).
    let (a, b) = TAIL_MEANS;
    let tail_mean = (b - a) / (b / a).ln();
    let (tail, bulk_mean) = match options.sizes {
        Sizes::ImageNet => (rng.next_f64() < TAIL_SHARE, mean * (1.0 - TAIL_SHARE * tail_mean) / (1.0 - TAIL_SHARE)),
        Sizes::LogNormal => (false, mean),
    };
    // Log-normal size: exp(mu + sigma * N(0,1)) with mean exp(mu + sigma^2/2) = the bulk's mean.
    let sigma = 0.5f64;
    let mu = bulk_mean.ln() - sigma * sigma / 2.0;
    let (u1, u2) = (rng.next_f64().max(f64::MIN_POSITIVE), rng.next_f64());
    let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    let size = if tail {
        (mean * a * (b / a).powf(u2)) as u64
    } else {
        ((mu + sigma * normal).exp() as u64).clamp(32, (bulk_mean as u64).max(32) * 8)
    };
    let size = size.max(32) as usize;
    let mut data = Vec::with_capacity(size);
    data.extend_from_slice(&[0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x10, b'J', b'F', b'I', b'F', 0, 1, 1, 0, 0, 1, 0, 1, 0, 0]);
    while data.len() + 8 <= size - 2 {
        data.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    while data.len() < size - 2 {
        data.push(rng.next_u64() as u8);
    }
    data.extend_from_slice(&[0xFF, 0xD9]);
    GenSample { key: format!("sample-{i:08}"), label, data }
}

/// The class directory name of label `label` in a generated file tree.
pub fn class_name(label: i64) -> String {
    format!("class-{label:04}")
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> GenError + '_ {
    move |source| GenError::Io { path: path.display().to_string(), source }
}

/// The `tf.train.Example` a generated TFRecord dataset stores for a sample (ImageNet's feature names).
pub fn example_bytes(s: &GenSample) -> Vec<u8> {
    let pieces = proto::example_pieces(&[
        ("image/encoded", WrapFeature::Bytes(&s.data)),
        ("image/class/label", WrapFeature::Int64(s.label)),
        ("image/filename", WrapFeature::Bytes(s.key.as_bytes())),
        ("image/format", WrapFeature::Bytes(b"JPEG")),
    ]);
    proto::pieces_to_bytes(&pieces, &[])
}

/// The Caffe `Datum` a generated LMDB dataset stores for a sample.
pub fn datum_bytes(s: &GenSample) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.data.len() + 32);
    for (field, value) in [(1u64, 3u64), (2, 224), (3, 224)] {
        proto::put_varint(&mut out, field << 3);
        proto::put_varint(&mut out, value);
    }
    proto::put_varint(&mut out, 4 << 3 | 2);
    proto::put_varint(&mut out, s.data.len() as u64);
    out.extend_from_slice(&s.data);
    proto::put_varint(&mut out, 5 << 3);
    proto::put_varint(&mut out, s.label as u64);
    proto::put_varint(&mut out, 7 << 3);
    proto::put_varint(&mut out, 1);
    out
}

/// Writes a dataset into `out` (created if missing).
pub fn generate(options: &GenOptions, out: &Path) -> Result<GenSummary, GenError> {
    if options.samples == 0 || options.shards == 0 {
        return Err(GenError::Options("samples and shards must be at least 1".into()));
    }
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let mut summary = GenSummary { samples: 0, bytes: 0, files: 0 };
    let shards = options.shards.min(options.samples);
    let shard_of = |i: u32| (u64::from(i) * u64::from(shards) / u64::from(options.samples)) as u32;
    match options.format {
        SourceFormat::Tfrecord | SourceFormat::Tar => {
            let mut i = 0;
            for shard in 0..shards {
                let name = match options.format {
                    SourceFormat::Tfrecord => format!("train-{shard:05}-of-{shards:05}.tfrecord"),
                    _ => format!("shard-{shard:06}.tar"),
                };
                let path = out.join(name);
                let file = std::fs::File::create(&path).map_err(io_err(&path))?;
                let mut w = BufWriter::with_capacity(1 << 20, file);
                let mut buf = Vec::new();
                while i < options.samples && shard_of(i) == shard {
                    let s = sample(options, i);
                    buf.clear();
                    if options.format == SourceFormat::Tfrecord {
                        tfrecord::encode_record(&example_bytes(&s), &mut buf);
                    } else {
                        let cls = s.label.to_string();
                        for (ext, data) in [("jpg", &s.data[..]), ("cls", cls.as_bytes())] {
                            buf.extend(tar::file_header(&format!("{}.{ext}", s.key), data.len() as u64));
                            buf.extend_from_slice(data);
                            buf.resize(buf.len() + tar::padding(data.len() as u64) as usize, 0);
                        }
                    }
                    w.write_all(&buf).map_err(io_err(&path))?;
                    summary.samples += 1;
                    summary.bytes += s.data.len() as u64;
                    i += 1;
                }
                if options.format == SourceFormat::Tar {
                    w.write_all(&[0u8; tar::END_LEN as usize]).map_err(io_err(&path))?;
                }
                w.into_inner().map_err(|e| e.into_error()).and_then(|f| f.sync_all()).map_err(io_err(&path))?;
                summary.files += 1;
            }
        }
        SourceFormat::Lmdb => {
            let lmdb_err = |e: heed::Error| GenError::Lmdb { path: out.display().to_string(), message: e.to_string() };
            let map_size = ((options.mean_bytes as usize * 8 + 4096) * options.samples as usize * 2 + (64 << 20))
                .next_multiple_of(1 << 16);
            let env = LmdbEnv::create(out, map_size, 0).map_err(lmdb_err)?;
            let result = (|| {
                let mut wtxn = env.env().write_txn().map_err(lmdb_err)?;
                let db = env
                    .env()
                    .create_database::<heed::types::Bytes, heed::types::Bytes>(&mut wtxn, None)
                    .map_err(lmdb_err)?;
                for i in 0..options.samples {
                    let s = sample(options, i);
                    db.put(&mut wtxn, s.key.as_bytes(), &datum_bytes(&s)).map_err(lmdb_err)?;
                    summary.samples += 1;
                    summary.bytes += s.data.len() as u64;
                }
                wtxn.commit().map_err(lmdb_err)
            })();
            env.close();
            result?;
            summary.files = 1;
        }
        SourceFormat::Files => {
            for i in 0..options.samples {
                let s = sample(options, i);
                let dir = out.join(class_name(s.label));
                std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
                let path = dir.join(format!("{}.jpg", s.key));
                std::fs::write(&path, &s.data).map_err(io_err(&path))?;
                summary.samples += 1;
                summary.bytes += s.data.len() as u64;
                summary.files += 1;
            }
        }
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{self, IndexOptions, NoProgress};

    #[test]
    fn sizes_spread_around_the_mean_with_imagenets_tail() {
        for sizes in [Sizes::ImageNet, Sizes::LogNormal] {
            let options = GenOptions { samples: 20_000, mean_bytes: 110_000, sizes, ..GenOptions::default() };
            let sizes_of: Vec<f64> = (0..options.samples).map(|i| sample(&options, i).data.len() as f64).collect();
            let mean = sizes_of.iter().sum::<f64>() / sizes_of.len() as f64;
            assert!((mean / 110_000.0 - 1.0).abs() < 0.05, "{sizes:?}: mean {mean}");
            let min = sizes_of.iter().cloned().fold(f64::MAX, f64::min);
            let max = sizes_of.iter().cloned().fold(0.0, f64::max);
            assert!(min < 60_000.0 && max > 200_000.0, "{sizes:?}: spread {min}..{max}");
            let huge = sizes_of.iter().filter(|&&s| s >= 10.0 * 110_000.0).count() as f64 / sizes_of.len() as f64;
            match sizes {
                // ~1 % of the samples are 1.1-5.5 MB, as ImageNet's largest photographs are.
                Sizes::ImageNet => assert!((0.007..0.013).contains(&huge) && max > 4e6, "tail {huge}, max {max}"),
                Sizes::LogNormal => assert!(huge == 0.0 && max <= 8.0 * 110_000.0, "max {max}"),
            }
            assert_eq!(sample(&options, 7), sample(&options, 7));
        }
        assert_eq!("imagenet".parse::<Sizes>(), Ok(Sizes::ImageNet));
        assert!("tame".parse::<Sizes>().is_err());
    }

    /// Every kind of generated dataset indexes back to exactly the generated samples.
    #[test]
    fn every_format_indexes_back() {
        for format in SourceFormat::ALL {
            let dir = tempfile::tempdir().unwrap();
            let options = GenOptions {
                format,
                samples: 37,
                mean_bytes: 3000,
                shards: 4,
                classes: 5,
                seed: 9,
                ..GenOptions::default()
            };
            let summary = generate(&options, dir.path()).unwrap();
            assert_eq!(summary.samples, 37);
            let index = source::build(dir.path(), &IndexOptions::default(), &NoProgress).unwrap();
            assert_eq!(index.format(), format, "detected format");
            assert_eq!(index.samples.len(), 37, "{format}");
            let mut expected: Vec<GenSample> = (0..37).map(|i| sample(&options, i)).collect();
            if format == SourceFormat::Files {
                expected.sort_by_key(|s| (class_name(s.label), s.key.clone()));
            }
            for (got, want) in index.samples.iter().zip(&expected) {
                let shard =
                    crate::mmap::MappedFile::open(&dir.path().join(&index.shards[got.parts[0].shard as usize].path))
                        .unwrap();
                let p = &got.parts[0];
                let bytes = &shard.bytes()[p.offset as usize..(p.offset + p.len) as usize];
                let payload = match format {
                    SourceFormat::Tfrecord => example_bytes(want),
                    SourceFormat::Lmdb => datum_bytes(want),
                    _ => want.data.clone(),
                };
                assert_eq!(bytes, &payload[..], "{format} {}", want.key);
                assert_eq!(got.label, want.label, "{format} label");
                let key = if format == SourceFormat::Files {
                    format!("{}/{}", class_name(want.label), want.key)
                } else {
                    want.key.clone()
                };
                assert_eq!(got.key, key);
            }
            for shard in &index.shards {
                let bytes = std::fs::read(dir.path().join(&shard.path)).unwrap();
                assert_eq!(shard.crc32c, crate::crc::crc32c(&bytes), "{format} shard {}", shard.path);
            }
            assert!(!dir.path().join("lock.mdb").exists() || format == SourceFormat::Lmdb);
        }
    }
}
