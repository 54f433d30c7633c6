//! What each inode is. Inode numbers encode what they name, so no table grows with the epochs read, and a
//! new process serving the same mount numbers everything the same way: the root is 1, `.batchfs` 2, its
//! `stats` 3, `rolling` 4, epoch directory *e* is `2^40 + e`, and batch *b* of epoch *e* is
//! `2^62 + e·2^36 + b·8 + kind` (kind 0: the batch, 1: its DALI index; as `rolling/` serves epoch *e*: 2 the
//! packed batch, 3 its index, 4 the indexed layout's file); the indexed layout's twin of name *b*, one file
//! for every epoch, is `2^43 + b`; node *n* of the `raw/` tree (built from the server's file list on first
//! use) is `2^41 + n` for a directory, `2^42 + n` for a file; `shuffled/` is 5, its class folder *c* is
//! `2^44 + c`, and sample *k* of class *c* in epoch *e* is `2^61 + e·2^41 + c·2^24 + k`. (`fs.rs`'s tree
//! shows what each names.)

use batchfs::encode::BatchFormat;
use batchfs::plan::MAX_EPOCH;

pub const ROOT: u64 = 1;
pub const META_DIR: u64 = 2;
pub const STATS_FILE: u64 = 3;
pub const ROLLING_DIR: u64 = 4;
pub const SHUFFLED_DIR: u64 = 5;
const EPOCH_BASE: u64 = 1 << 40;
const RAW_DIR_BASE: u64 = 1 << 41;
const RAW_FILE_BASE: u64 = 1 << 42;
const ROLLING_INDEX_BASE: u64 = 1 << 43;
const SHUFFLED_CLASS_BASE: u64 = 1 << 44;
const SHUFFLED_BASE: u64 = 1 << 61;
/// Classes of `shuffled/` are below this (17 bits of a sample's inode).
pub const MAX_CLASSES: u64 = 1 << 17;
/// Samples of one class in one epoch (of a mount's share) are below this (24 bits).
pub const MAX_CLASS_SAMPLES: u64 = 1 << 24;
const BATCH_BASE: u64 = 1 << 62;
/// Batch numbers are below this (33 bits of a batch inode).
pub(super) const MAX_BATCHES: u64 = 1 << 33;

/// What an inode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    Root,
    MetaDir,
    Stats,
    Epoch(u64),
    /// A batch file of an epoch directory; `index` for its `.tfrecord.idx` twin.
    Batch {
        epoch: u64,
        batch: u64,
        index: bool,
    },
    /// `rolling/`.
    RollingDir,
    /// A file of `rolling/` as it serves epoch `epoch`.
    Rolling {
        epoch: u64,
        batch: u64,
        file: RollingFile,
    },
    /// The `.tfrecord.idx` twin of name `batch` of `rolling/` in the indexed layout: one file for every
    /// epoch.
    RollingIndex {
        batch: u64,
    },
    /// A directory of the `raw/` tree (node 0 is `raw` itself).
    RawDir(u32),
    /// A source file in the `raw/` tree.
    RawFile(u32),
    /// `shuffled/`.
    ShuffledDir,
    /// A class folder of `shuffled/`.
    ShuffledClass(u32),
    /// Sample `k` of class `class` in epoch `epoch` of `shuffled/` (this mount's share, plan order), as an
    /// open of a name of the class got it.
    Shuffled {
        epoch: u64,
        class: u32,
        k: u64,
    },
}

/// What a file of `rolling/` is, in the epoch it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RollingFile {
    /// The epoch's batch as its epoch directory has it.
    Packed,
    /// Its DALI index.
    PackedIndex,
    /// The batch's records at the fixed offsets of the indexed layout.
    Indexed,
}

impl Node {
    pub fn ino(self) -> u64 {
        let batch_ino = |epoch: u64, batch: u64, kind: u64| BATCH_BASE | epoch << 36 | batch << 3 | kind;
        match self {
            Node::Root => ROOT,
            Node::MetaDir => META_DIR,
            Node::Stats => STATS_FILE,
            Node::Epoch(e) => EPOCH_BASE + e,
            Node::Batch { epoch, batch, index } => batch_ino(epoch, batch, u64::from(index)),
            Node::Rolling { epoch, batch, file } => batch_ino(
                epoch,
                batch,
                match file {
                    RollingFile::Packed => 2,
                    RollingFile::PackedIndex => 3,
                    RollingFile::Indexed => 4,
                },
            ),
            Node::RollingDir => ROLLING_DIR,
            Node::RollingIndex { batch } => ROLLING_INDEX_BASE + batch,
            Node::RawDir(n) => RAW_DIR_BASE + u64::from(n),
            Node::RawFile(n) => RAW_FILE_BASE + u64::from(n),
            Node::ShuffledDir => SHUFFLED_DIR,
            Node::ShuffledClass(c) => SHUFFLED_CLASS_BASE + u64::from(c),
            Node::Shuffled { epoch, class, k } => SHUFFLED_BASE | epoch << 41 | u64::from(class) << 24 | k,
        }
    }

    pub fn from_ino(ino: u64) -> Option<Node> {
        match ino {
            ROOT => Some(Node::Root),
            META_DIR => Some(Node::MetaDir),
            STATS_FILE => Some(Node::Stats),
            ROLLING_DIR => Some(Node::RollingDir),
            SHUFFLED_DIR => Some(Node::ShuffledDir),
            i if i >= BATCH_BASE => {
                let rest = i - BATCH_BASE;
                let (epoch, batch) = (rest >> 36, (rest >> 3) & (MAX_BATCHES - 1));
                let rolling = |file| Some(Node::Rolling { epoch, batch, file });
                match rest & 7 {
                    0 => Some(Node::Batch { epoch, batch, index: false }),
                    1 => Some(Node::Batch { epoch, batch, index: true }),
                    2 => rolling(RollingFile::Packed),
                    3 => rolling(RollingFile::PackedIndex),
                    4 => rolling(RollingFile::Indexed),
                    _ => None,
                }
            }
            i if (ROLLING_INDEX_BASE..ROLLING_INDEX_BASE + MAX_BATCHES).contains(&i) => {
                Some(Node::RollingIndex { batch: i - ROLLING_INDEX_BASE })
            }
            i if (EPOCH_BASE..=EPOCH_BASE + MAX_EPOCH).contains(&i) => Some(Node::Epoch(i - EPOCH_BASE)),
            i if (RAW_DIR_BASE..RAW_DIR_BASE + (1 << 32)).contains(&i) => Some(Node::RawDir((i - RAW_DIR_BASE) as u32)),
            i if (RAW_FILE_BASE..RAW_FILE_BASE + (1 << 32)).contains(&i) => {
                Some(Node::RawFile((i - RAW_FILE_BASE) as u32))
            }
            i if (SHUFFLED_CLASS_BASE..SHUFFLED_CLASS_BASE + MAX_CLASSES).contains(&i) => {
                Some(Node::ShuffledClass((i - SHUFFLED_CLASS_BASE) as u32))
            }
            i if (SHUFFLED_BASE..BATCH_BASE).contains(&i) => {
                let rest = i - SHUFFLED_BASE;
                let epoch = rest >> 41;
                let class = ((rest >> 24) & (MAX_CLASSES - 1)) as u32;
                (epoch <= MAX_EPOCH).then_some(Node::Shuffled { epoch, class, k: rest & (MAX_CLASS_SAMPLES - 1) })
            }
            _ => None,
        }
    }

    pub fn is_dir(self) -> bool {
        matches!(
            self,
            Node::Root
                | Node::MetaDir
                | Node::Epoch(_)
                | Node::RawDir(_)
                | Node::RollingDir
                | Node::ShuffledDir
                | Node::ShuffledClass(_)
        )
    }
}

/// Name of epoch directory `e`.
pub fn epoch_name(e: u64) -> String {
    format!("epoch-{e:04}")
}

/// Name of batch file `batch` in `format` (`BatchFormat::TfrecordIdx` for the `.idx` twin).
pub fn batch_name(batch: u64, format: BatchFormat) -> String {
    format!("batch-{batch:06}.{}", format.extension())
}

pub(super) fn parse_epoch(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("epoch-")?;
    let e: u64 = digits.parse().ok()?;
    (digits.bytes().all(|b| b.is_ascii_digit()) && epoch_name(e) == name && e <= MAX_EPOCH).then_some(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_node() -> impl Strategy<Value = Node> {
        let epoch = 0..=MAX_EPOCH;
        prop_oneof![
            Just(Node::Root),
            Just(Node::MetaDir),
            Just(Node::Stats),
            Just(Node::RollingDir),
            Just(Node::ShuffledDir),
            epoch.clone().prop_map(Node::Epoch),
            (epoch.clone(), 0..MAX_BATCHES, any::<bool>()).prop_map(|(epoch, batch, index)| Node::Batch {
                epoch,
                batch,
                index
            }),
            (epoch.clone(), 0..MAX_BATCHES, 0..3u8).prop_map(|(epoch, batch, f)| Node::Rolling {
                epoch,
                batch,
                file: [RollingFile::Packed, RollingFile::PackedIndex, RollingFile::Indexed][f as usize],
            }),
            (0..MAX_BATCHES).prop_map(|batch| Node::RollingIndex { batch }),
            any::<u32>().prop_map(Node::RawDir),
            any::<u32>().prop_map(Node::RawFile),
            (0..MAX_CLASSES as u32).prop_map(Node::ShuffledClass),
            (epoch, 0..MAX_CLASSES as u32, 0..MAX_CLASS_SAMPLES).prop_map(|(epoch, class, k)| Node::Shuffled {
                epoch,
                class,
                k
            }),
        ]
    }

    proptest! {
        /// Every node's inode names it and no other: numbers of different kinds never meet.
        #[test]
        fn inodes_round_trip(node in any_node()) {
            prop_assert_eq!(Node::from_ino(node.ino()), Some(node));
        }
    }
}
