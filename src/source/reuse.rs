//! Indexing again only what changed. A dataset whose persisted index is stale (a shard added, rewritten or
//! removed; an object of a bucket uploaded again) keeps what that index says of every file unchanged since
//! it was built (the same path, size, modification time and ETag, as [`ShardInfo::same_file`] compares):
//! its samples, its checksums and what was skipped in it. Only new and changed files are read, so adding one
//! shard to a dataset of a thousand reads one shard, not the whole dataset again (from a bucket: not every
//! object again).
//!
//! What is kept is what a fresh build would make of the same bytes: a shard's samples come from that shard
//! alone (TFRecord, WebDataset tar) and a file's sample from that file (a file tree, whose labels are
//! derived again from the classes listed now). An LMDB environment is one file, read again whole.

use crate::index::{Index, IndexSettings, Part, Sample, ShardInfo, Skipped, SourceFormat};
use std::collections::HashMap;

/// What an earlier index of the dataset knew, by file.
pub(crate) struct Previous<'a> {
    index: &'a Index,
    shards: HashMap<&'a str, usize>,
    side: HashMap<&'a str, &'a ShardInfo>,
    /// Each shard's samples (their positions in `index.samples`), for the formats whose samples each lie in
    /// one shard.
    samples: Vec<Vec<usize>>,
}

impl<'a> Previous<'a> {
    /// `index`, for a build of `settings`: none where it was built with others (another format, or corrupt
    /// regions skipped where they are now refused: every file is read again).
    pub(crate) fn new(index: &'a Index, settings: IndexSettings) -> Option<Previous<'a>> {
        if index.settings != settings {
            return None;
        }
        // Only shard formats take samples from it (a file tree's file is a sample made again, an LMDB read
        // again): for a tree of a million files, no list of each file's samples.
        let takes_samples = matches!(settings.format, SourceFormat::Tfrecord | SourceFormat::Tar);
        let mut samples = vec![Vec::new(); if takes_samples { index.shards.len() } else { 0 }];
        for (i, sample) in index.samples.iter().enumerate().filter(|_| takes_samples) {
            let shard = sample.parts.first().map(|p| p.shard as usize);
            match shard.filter(|&s| sample.parts.iter().all(|p| p.shard as usize == s) && s < samples.len()) {
                Some(s) => samples[s].push(i),
                // A sample across shards (none of the formats makes one): nothing of this index is taken.
                None => return None,
            }
        }
        Some(Previous {
            index,
            shards: index.shards.iter().enumerate().map(|(i, s)| (s.path.as_str(), i)).collect(),
            side: index.side.iter().map(|s| (s.path.as_str(), s)).collect(),
            samples,
        })
    }

    /// The earlier index's entry of shard `file`, where the file is unchanged since.
    fn shard(&self, file: &ShardInfo) -> Option<usize> {
        self.shards.get(file.path.as_str()).copied().filter(|&i| self.index.shards[i].same_file(file))
    }

    /// The checksums of `file` (a side file, or a shard of a file tree), where it is unchanged since.
    pub(crate) fn checksums(&self, file: &ShardInfo, side: bool) -> Option<(u32, crate::index::ChunkCrcs)> {
        self.known(file, side).map(|s| (s.crc32c, s.chunks.clone()))
    }

    /// The earlier index's entry of `file` (a side file, or a shard), where the file is unchanged since.
    pub(crate) fn known(&self, file: &ShardInfo, side: bool) -> Option<&ShardInfo> {
        match side {
            true => self.side.get(file.path.as_str()).copied().filter(|s| s.same_file(file)),
            false => self.shard(file).map(|i| &self.index.shards[i]),
        }
    }

    /// Appends to `index` what the earlier index holds of its shard `shard_no` (its samples, checksums and
    /// skipped regions), if that file is unchanged since; `false` where it must be read.
    pub(crate) fn take(&self, index: &mut Index, shard_no: usize) -> bool {
        let Some(from) = self.shard(&index.shards[shard_no]) else {
            return false;
        };
        let shard = shard_no as u32;
        index.samples.extend(self.samples[from].iter().map(|&i| {
            let Sample { key, label, parts } = &self.index.samples[i];
            let parts = parts.iter().map(|p| Part { shard, ..p.clone() }).collect();
            Sample { key: key.clone(), label: *label, parts }
        }));
        let known = &self.index.shards[from];
        (index.shards[shard_no].crc32c, index.shards[shard_no].chunks) = (known.crc32c, known.chunks.clone());
        let path = &known.path;
        index.skipped.extend(self.index.skipped.iter().filter(|s| s.shard == path.as_str()).map(Skipped::clone));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::{build_from, discover, Directory, Files, IndexOptions, Local, NoProgress};
    use crate::gen::{self, GenOptions};
    use crate::index::{Index, ShardInfo, SourceFormat};
    use std::path::Path;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A local dataset whose reads are counted (the bytes of each file handed out).
    struct Counted<'a>(Directory<'a>, AtomicU64);

    impl Files for Counted<'_> {
        fn root(&self) -> &Path {
            self.0.root()
        }
        fn local(&self, file: &ShardInfo) -> std::io::Result<Local> {
            self.1.fetch_add(file.size, Ordering::Relaxed);
            self.0.local(file)
        }
    }

    /// The index of `dir` as it is now, built from `previous` (and the bytes that took) or from nothing.
    fn index(dir: &Path, options: &IndexOptions, format: SourceFormat, previous: Option<&Index>) -> (Index, u64) {
        let (shards, side) = discover(dir, format, false).unwrap();
        let files = Counted(Directory(dir), AtomicU64::new(0));
        let index = build_from(&files, options.settings(format), shards, side, previous, &NoProgress).unwrap();
        (index, files.1.into_inner())
    }

    fn generated(format: SourceFormat, seed: u64, dir: &Path) {
        let options =
            GenOptions { format, samples: 60, mean_bytes: 3000, shards: 4, classes: 3, seed, ..GenOptions::default() };
        gen::generate(&options, dir).unwrap();
    }

    /// Whatever changed (a file rewritten, one added, one removed, a side file edited), the index built
    /// from the stale one is the index built from nothing, byte for byte, and only what changed was read.
    #[test]
    fn an_index_built_again_from_a_stale_one_is_the_fresh_one_and_reads_only_what_changed() {
        for format in [SourceFormat::Tfrecord, SourceFormat::Tar, SourceFormat::Files] {
            let dir = tempfile::tempdir().unwrap();
            generated(format, 1, dir.path());
            std::fs::write(dir.path().join("README"), b"about").unwrap();
            let options = IndexOptions::default();
            let (stale, _) = index(dir.path(), &options, format, None);
            let (shards, _) = discover(dir.path(), format, false).unwrap();
            // One shard rewritten with other samples (another seed's file of the same name), one removed,
            // one added (a file of another class, for a file tree: every label moves), a side file edited.
            let other = tempfile::tempdir().unwrap();
            generated(format, 2, other.path());
            let (theirs, _) = discover(other.path(), format, false).unwrap();
            let (rewritten, removed) = (&shards[1].path, &shards[2].path);
            std::fs::copy(other.path().join(theirs[1].path.as_str()), dir.path().join(rewritten.as_str())).unwrap();
            std::fs::remove_file(dir.path().join(removed.as_str())).unwrap();
            let added = match format {
                SourceFormat::Files => "class-0/aaa.bin",
                SourceFormat::Tar => "zzz-added.tar",
                _ => "zzz-added.tfrecord",
            };
            std::fs::create_dir_all(dir.path().join(added).parent().unwrap()).unwrap();
            std::fs::copy(other.path().join(theirs[0].path.as_str()), dir.path().join(added)).unwrap();
            std::fs::write(dir.path().join("README"), b"about it").unwrap();

            let (fresh, read_fresh) = index(dir.path(), &options, format, None);
            let (again, read_again) = index(dir.path(), &options, format, Some(&stale));
            assert_eq!(again.to_bytes(), fresh.to_bytes(), "{format:?}");
            assert_eq!(again, fresh, "{format:?}");
            let changed = [rewritten.as_str(), added, "README"];
            let size = |path: &str| std::fs::metadata(dir.path().join(path)).unwrap().len();
            assert_eq!(read_again, changed.iter().map(|p| size(p)).sum::<u64>(), "{format:?}: read only what changed");
            let (shards, side) = discover(dir.path(), format, false).unwrap();
            assert_eq!(read_fresh, shards.iter().chain(&side).map(|f| f.size).sum::<u64>(), "{format:?}: all of it");
            assert!(read_again < read_fresh, "{format:?}");
            // Built with other settings, nothing is taken from it.
            let skipping = IndexOptions { skip_corrupt: true, ..IndexOptions::default() };
            assert_eq!(index(dir.path(), &skipping, format, Some(&stale)).1, read_fresh, "{format:?}");
        }
    }

    /// An index of other rules for its format (one kept macOS `._` tar members as samples) is neither
    /// loaded nor taken from: what it says of unchanged files is what those rules made of them.
    #[test]
    fn an_index_of_other_rules_is_neither_loaded_nor_taken_from() {
        use super::super::{load_or_build, IndexOrigin, INDEX_FILE_NAME};
        let dir = tempfile::tempdir().unwrap();
        generated(SourceFormat::Tfrecord, 1, dir.path());
        let options = IndexOptions::default();
        load_or_build(dir.path(), "d", None, &options, &NoProgress).unwrap();
        let path = dir.path().join(INDEX_FILE_NAME);
        let mut bytes = std::fs::read(&path).unwrap();
        assert!(Index::from_bytes(&bytes).is_some());
        // `BATCHFSI`, the layout, the format, its rules (one byte, a varint under 128), and the checksum
        // made again.
        let rules = u8::try_from(SourceFormat::Tfrecord.rules()).unwrap();
        assert_eq!(bytes[13], rules);
        let with_rules = |bytes: &mut Vec<u8>, rules: u8| {
            bytes[13] = rules;
            let end = bytes.len() - 4;
            let sum = crate::crc::crc32c(&bytes[..end]);
            bytes[end..].copy_from_slice(&sum.to_le_bytes());
        };
        with_rules(&mut bytes, rules);
        assert!(Index::from_bytes(&bytes).is_some(), "the checksum made as the index makes it");
        with_rules(&mut bytes, rules - 1);
        assert!(Index::from_bytes(&bytes).is_none(), "an index of the rules before is no stale index to take from");
        std::fs::write(&path, &bytes).unwrap();
        let (_, origin) = load_or_build(dir.path(), "d", None, &options, &NoProgress).unwrap();
        assert_eq!(origin, IndexOrigin::Built);
    }

    /// A corrupt region skipped in an unchanged shard is skipped again (the stale index says where), and a
    /// shard corrupted since is read and its corruption found.
    #[test]
    fn regions_skipped_in_unchanged_shards_stay_skipped_and_new_corruption_is_found() {
        let dir = tempfile::tempdir().unwrap();
        generated(SourceFormat::Tfrecord, 1, dir.path());
        let skipping = IndexOptions { skip_corrupt: true, ..IndexOptions::default() };
        let (shards, _) = discover(dir.path(), SourceFormat::Tfrecord, false).unwrap();
        let corrupt = |n: usize| {
            let path = dir.path().join(shards[n].path.as_str());
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[20] ^= 0xff; // the first record's data
            std::fs::write(&path, bytes).unwrap();
        };
        corrupt(0);
        let (stale, _) = index(dir.path(), &skipping, SourceFormat::Tfrecord, None);
        assert_eq!(stale.skipped.len(), 1);
        corrupt(3);
        let (fresh, _) = index(dir.path(), &skipping, SourceFormat::Tfrecord, None);
        let (again, read) = index(dir.path(), &skipping, SourceFormat::Tfrecord, Some(&stale));
        assert_eq!(again, fresh);
        assert_eq!(again.skipped.len(), 2);
        assert_eq!(read, std::fs::metadata(dir.path().join(shards[3].path.as_str())).unwrap().len());
    }
}
