//! What a dataset answers of its samples by id: the sample table, and the layout of samples' data.

use super::Dataset;
use batchfs::encode::{self, BatchLayout};

impl Dataset {
    /// Every sample's label, data size and CRC32C, encoded ([`batchfs::api::SampleTable`]; made once).
    pub fn sample_table(&self) -> bytes::Bytes {
        self.sample_table
            .get_or_init(|| {
                let samples = &self.index.samples;
                let mut t = batchfs::api::SampleTable {
                    labels: Vec::with_capacity(samples.len()),
                    crc32c: Vec::with_capacity(samples.len()),
                    bytes: Vec::with_capacity(samples.len()),
                    // Sent in a header ([`Dataset::index_id`]), not in the table's bytes.
                    index_id: String::new(),
                };
                for sample in samples {
                    let label = u32::try_from(sample.label).unwrap_or(batchfs::api::SampleTable::NO_LABEL);
                    let crc = sample.parts.iter().fold(0, |crc, p| batchfs::crc::combine(crc, p.crc32c, p.len));
                    t.labels.push(label);
                    t.crc32c.push(crc);
                    t.bytes.push(sample.bytes());
                }
                t.encode().into()
            })
            .clone()
    }

    /// The layout of the data of samples `ids`, one after another.
    pub fn data_layout(&self, ids: &[u32]) -> BatchLayout {
        encode::data_layout(&self.index, ids)
    }
}
