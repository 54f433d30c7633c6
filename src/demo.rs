//! What the two demos share (`batchfs-server demo` reads an epoch over HTTP/2, `batchfs-lab demo` through a
//! mount): the sample dataset, the end-to-end check of every batch read against its manifest entry, and
//! the result table. Each demo keeps only what differs: how it serves and how it reads.

use crate::api::BatchEntry;
use crate::gen::GenOptions;
use crate::index::SourceFormat;
use std::fmt;

/// The generated TFRecord dataset both demos read: seed 0 and 10 classes, so the same arguments write
/// the same bytes.
pub fn sample_dataset(samples: u32, mean_bytes: u64, shards: u32) -> GenOptions {
    GenOptions {
        format: SourceFormat::Tfrecord,
        samples,
        mean_bytes,
        shards,
        classes: 10,
        seed: 0,
        ..GenOptions::default()
    }
}

/// The arguments both demos take: the sample dataset and the batch size.
#[cfg(feature = "clap")]
#[derive(Debug, Clone, clap::Args)]
pub struct SampleArgs {
    /// Samples in the generated dataset.
    #[arg(long, default_value_t = GenOptions::default().samples)]
    pub samples: u32,
    /// Mean sample size.
    #[arg(
        long,
        value_name = "SIZE",
        value_parser = crate::units::parse_size,
        default_value_t = GenOptions::default().mean_bytes
    )]
    pub mean_bytes: u64,
    /// TFRecord shards.
    #[arg(long, default_value_t = GenOptions::default().shards)]
    pub shards: u32,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: u32,
}

#[cfg(feature = "clap")]
impl SampleArgs {
    /// The dataset these arguments describe.
    pub fn dataset(&self) -> GenOptions {
        sample_dataset(self.samples, self.mean_bytes, self.shards)
    }
}

/// Batches read and checked so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub batches: u64,
    pub bytes: u64,
}

impl Tally {
    /// Counts one batch read whole (`len` bytes with CRC32C `crc`), or says how it differs from the
    /// manifest's entry. A demo that prints a table has checked every byte it counts.
    pub fn check(&mut self, epoch: u64, entry: &BatchEntry, len: u64, crc: u32) -> Result<(), Mismatch> {
        if len != entry.bytes || crc != entry.crc32c {
            return Err(Mismatch { epoch, batch: entry.index, len, crc, expected: (entry.bytes, entry.crc32c) });
        }
        self.batches += 1;
        self.bytes += len;
        Ok(())
    }
}

/// A batch read whole that differs from its manifest entry: its length and CRC32C, and the entry's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "batch {batch} of epoch {epoch}: read {len} bytes with CRC32C {crc:08x}, the manifest says {} bytes, {:08x}",
    expected.0, expected.1
)]
pub struct Mismatch {
    pub epoch: u64,
    pub batch: u64,
    pub len: u64,
    pub crc: u32,
    pub expected: (u64, u32),
}

/// A demo's result: a title, a rule and one `name value` row per line.
#[derive(Debug)]
pub struct Table {
    pub title: String,
    pub rows: Vec<(&'static str, String)>,
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 2;
        writeln!(f, "{}", self.title)?;
        writeln!(f, "{:-<72}", "")?;
        for (name, value) in &self.rows {
            writeln!(f, "{name:<width$}{value}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_counts_only_when_length_and_checksum_match() {
        let entry = BatchEntry { index: 3, samples: 2, bytes: 10, crc32c: 0xabcd };
        let mut tally = Tally::default();
        tally.check(0, &entry, 10, 0xabcd).unwrap();
        let err = tally.check(0, &entry, 10, 0xabce).unwrap_err();
        assert_eq!(err, Mismatch { epoch: 0, batch: 3, len: 10, crc: 0xabce, expected: (10, 0xabcd) });
        let text = err.to_string();
        assert!(text.contains("batch 3 of epoch 0") && text.contains("0000abce"), "{text}");
        assert!(tally.check(0, &entry, 9, 0xabcd).is_err());
        assert_eq!(tally, Tally { batches: 1, bytes: 10 });
    }

    #[test]
    fn table_aligns_values() {
        let t = Table { title: "t".into(), rows: vec![("a", "1".into()), ("long name", "2".into())] };
        let text = t.to_string();
        assert!(text.contains("\na          1\n") && text.contains("\nlong name  2\n"), "{text}");
    }
}
