//! An LMDB environment's indexing (`data.mdb`): its main database's values located in the file by
//! LMDB's own mapping and checked byte for byte, a file cut short refused, named databases left out
//! (refused where they hold every sample). A sample's key is its LMDB key byte for byte, or, in an
//! environment with a key that is not UTF-8, every key's bytes in hex (keys are text; read lossily, two
//! keys became one).

mod validate;

pub use validate::Damage;

use super::{io_err, Files, IndexError, Progress};
use crate::index::{Exts, Index, Part, Parts, Sample, NO_LABEL};
use crate::mmap::{LmdbEnv, MappedFile};
use crate::{crc, proto};
use std::path::Path;

/// The bytes an LMDB file's last committed transaction uses, from its current meta page: `(last page + 1) ×
/// page size`. `None` where the meta pages are not LMDB's or do not agree ([`validate::current_meta`]).
pub(super) fn needed_bytes(file: &[u8]) -> Option<u64> {
    let meta = validate::current_meta(file).ok()?;
    meta.last_page.checked_add(1)?.checked_mul(meta.page_size)
}

/// The main database may hold several values under one key (`MDB_DUPSORT` in LMDB's `mdb.c`).
const MDB_DUPSORT: u16 = 0x04;

pub(super) fn index(files: &dyn Files, index: &mut Index, progress: &dyn Progress) -> Result<(), IndexError> {
    let root = files.root();
    let lmdb_err = |e: heed::Error| IndexError::Lmdb { path: root.to_owned(), message: e.to_string() };
    // A staged copy must stay while LMDB has it open.
    let local = files.local(&index.shards[0]).map_err(io_err(&root.join("data.mdb")))?;
    let data_path = local.path.clone();
    let ours = MappedFile::open(&data_path).map_err(io_err(&data_path))?;
    let refuse = |message: String| IndexError::Lmdb { path: root.to_owned(), message };
    if ours.is_empty() {
        // LMDB said "Bad file descriptor".
        return Err(refuse("data.mdb is empty: no LMDB environment was written there".into()));
    }
    let damaged = |source: Damage| IndexError::LmdbDamaged { path: root.to_owned(), source };
    // Before LMDB reads the file: its meta pages (LMDB maps as many pages as the current one says, of the
    // size it says)...
    let meta = validate::current_meta(ours.bytes()).map_err(damaged)?;
    if meta.main_flags & MDB_DUPSORT != 0 {
        // Read as one value a key, a key's values were its sub-page's bytes, or left out as if a named
        // database; a sample's key would not name one sample either.
        return Err(refuse(
            "its main database keeps several values under one key (MDB_DUPSORT), which batchfs does not \
             serve: one value per key, as Caffe and most loaders write"
                .into(),
        ));
    }
    // Before LMDB maps it: a page past the end of a file cut short is a SIGBUS, not an error.
    if let Some(needed) = Some(needed_bytes(ours.bytes()).unwrap_or(u64::MAX)).filter(|&n| n > ours.len()) {
        return Err(IndexError::Lmdb {
            path: root.to_owned(),
            message: format!(
                "data.mdb is {} bytes, but its last transaction uses {needed}: the file is truncated (copied in \
                 part, or still being written)",
                ours.len()
            ),
        });
    }
    // ... and the main database's tree: LMDB follows its page numbers, offsets and sizes unchecked.
    validate::walk(ours.bytes(), &meta).map_err(damaged)?;
    let dir = data_path.parent().unwrap_or(root);
    let env = LmdbEnv::open_read_only(dir).map_err(lmdb_err)?;
    let result = (|| {
        let mut base = None;
        let rtxn = env.env().read_txn().map_err(lmdb_err)?;
        let db = env
            .env()
            .open_database::<heed::types::Bytes, heed::types::Bytes>(&rtxn, None)
            .map_err(lmdb_err)?
            .ok_or_else(|| IndexError::Lmdb { path: root.to_owned(), message: "no main database".into() })?;
        let mut last = 0u64;
        let mut exts = Exts::default();
        let mut named = Vec::new();
        let (first, mut hex_keys) = (index.samples.len(), false);
        for item in db.iter(&rtxn).map_err(lmdb_err)? {
            let (key, value) = item.map_err(lmdb_err)?;
            let base = match base {
                Some(b) => b,
                None => {
                    *base.insert(mapping_base(value.as_ptr() as usize, &data_path).ok_or_else(|| IndexError::Lmdb {
                        path: root.to_owned(),
                        message: "cannot find LMDB's mapping of data.mdb in /proc/self/maps".into(),
                    })?)
                }
            };
            // A named database's record in the main database is a node like a value's, told apart only by
            // its flag; its 48 bytes are no sample.
            let key_offset = (key.as_ptr() as usize).wrapping_sub(base) as u64;
            if node_flags(ours.bytes(), key_offset, key).is_some_and(|f| f & F_SUBDATA != 0) {
                named.push(shown(key));
                continue;
            }
            let offset = (value.as_ptr() as usize).wrapping_sub(base) as u64;
            let end = offset.checked_add(value.len() as u64);
            // The value must be where LMDB says it is in the file we serve from.
            let in_file = end.filter(|&e| e <= ours.len()).map(|e| &ours.bytes()[offset as usize..e as usize]);
            if end.is_none_or(|e| e > ours.len()) {
                // LMDB reads its pages past the end of a file cut short (its map is larger than the file).
                return Err(IndexError::Lmdb {
                    path: root.to_owned(),
                    message: format!(
                        "data.mdb is {} bytes, but the value of key {} lies at {offset}..{}: the file is \
                         truncated (copied in part, or still being written) or damaged",
                        ours.len(),
                        shown(key),
                        end.map_or_else(|| "?".to_owned(), |e| e.to_string())
                    ),
                });
            }
            if in_file != Some(value) {
                return Err(IndexError::Lmdb {
                    path: root.to_owned(),
                    message: format!("value of key {} is not stored contiguously in data.mdb", shown(key)),
                });
            }
            // Keys are text in the index, in tar member names and in the TFRecord `key` feature: read
            // lossily, b"\xfe" and b"\xff" were both "\u{FFFD}", and a reader got a key LMDB never held. An
            // environment with a key that is not UTF-8 (integers written as their bytes) has every key given
            // as its bytes in lower-case hex: one rule for all its keys, so no two become one.
            let key = match (hex_keys, std::str::from_utf8(key)) {
                (false, Ok(text)) => text.into(),
                (false, Err(_)) => {
                    hex_keys = true;
                    tracing::warn!(
                        path = %root.join("data.mdb").display(),
                        key = %shown(key),
                        "an LMDB key is not UTF-8: every key of this environment is served as its bytes in hex"
                    );
                    for sample in &mut index.samples[first..] {
                        sample.key = hex(sample.key.as_bytes()).as_str().into();
                    }
                    hex(key).as_str().into()
                }
                (true, _) => hex(key).as_str().into(),
            };
            let label = proto::datum_label(value).ok().flatten();
            index.samples.push(Sample {
                key,
                label: label.unwrap_or(NO_LABEL),
                parts: Parts::from(Part {
                    ext: exts.get(if label.is_some() { "datum" } else { "bin" }),
                    shard: 0,
                    offset,
                    len: value.len() as u64,
                    crc32c: crc::crc32c(value),
                }),
            });
            progress.advance(value.len() as u64);
            last += value.len() as u64;
        }
        if !named.is_empty() {
            const LISTED: usize = 8;
            let mut names = named.iter().take(LISTED).map(String::as_str).collect::<Vec<_>>().join(", ");
            if named.len() > LISTED {
                names.push_str(&format!(" and {} more", named.len() - LISTED));
            }
            // Samples in the main database beside named ones (a writer's metadata kept apart): those are
            // served, and the named ones left out, said once. Samples only in named ones: refused.
            if index.samples.is_empty() {
                return Err(IndexError::NamedDatabases { path: root.join("data.mdb"), names });
            }
            tracing::warn!(
                path = %root.join("data.mdb").display(),
                samples = index.samples.len(),
                named = %names,
                "named LMDB databases are left out: batchfs serves the main database's samples"
            );
        }
        progress.advance(ours.len().saturating_sub(last));
        index.shards[0].checksum(ours.bytes());
        Ok(())
    })();
    env.close();
    result
}

/// `bytes` in lower-case hex, two digits a byte: a key that is not UTF-8 as text, told apart from every
/// other key so given.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A key for a message, quoted: its first 64 bytes (a damaged page's key can be any length: one was 133 KB),
/// bytes that are not UTF-8 escaped as a file name's are (`"\xFE"`), never replaced.
fn shown(key: &[u8]) -> String {
    use std::os::unix::ffi::OsStrExt;
    const SHOWN: usize = 64;
    let quoted = |bytes: &[u8]| format!("{:?}", std::ffi::OsStr::from_bytes(bytes));
    match key.len() > SHOWN {
        true => format!("{}... ({} bytes)", quoted(&key[..SHOWN]), key.len()),
        false => quoted(key),
    }
}

/// The flag of a node of LMDB's main database that holds a named database's record instead of a value
/// (`F_SUBDATA` in LMDB's `mdb.c`).
const F_SUBDATA: u16 = 0x02;

/// The flags of the LMDB leaf node whose key LMDB handed out as `key`, found at `key_offset` of `file`
/// (`data.mdb`): a node is `lo, hi, flags, ksize` (u16 each, in the machine's byte order) then the key.
/// `None` where the bytes there are not that key's node.
fn node_flags(file: &[u8], key_offset: u64, key: &[u8]) -> Option<u16> {
    let at = usize::try_from(key_offset).ok()?;
    let header = file.get(at.checked_sub(8)?..at)?;
    let ksize = u16::from_ne_bytes([header[6], header[7]]);
    let in_file = file.get(at..at.checked_add(key.len())?)?;
    (usize::from(ksize) == key.len() && in_file == key).then(|| u16::from_ne_bytes([header[4], header[5]]))
}

/// The address at which file offset 0 of `file` would be, for the mapping of `file` that contains `addr`
/// (LMDB does not publish where it mapped `data.mdb`; the kernel does).
fn mapping_base(addr: usize, file: &Path) -> Option<usize> {
    let file = std::fs::canonicalize(file).ok()?;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        // start-end perms offset dev inode path (the path may contain spaces: it is the rest of the line)
        let mut rest = line;
        let mut field = || {
            rest = rest.trim_start();
            let end = rest.find(' ').unwrap_or(rest.len());
            let (f, r) = rest.split_at(end);
            rest = r;
            f
        };
        let (start, end) = field().split_once('-')?;
        let (start, end) = (usize::from_str_radix(start, 16).ok()?, usize::from_str_radix(end, 16).ok()?);
        field();
        let offset = usize::from_str_radix(field(), 16).ok()?;
        field();
        field();
        let path = rest.trim_start();
        ((start..end).contains(&addr) && Path::new(path) == file).then(|| start - offset)
    })
}

#[cfg(test)]
mod tests {
    use super::super::{build, IndexOptions, NoProgress};
    use crate::mmap::LmdbEnv;
    use proptest::collection::{btree_set, vec};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// An LMDB environment in a new directory whose main database holds `keys`, each with a value of its own.
    fn environment<'a>(keys: impl IntoIterator<Item = &'a [u8]>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let env = LmdbEnv::create(dir.path(), 1 << 20, 0).unwrap();
        let mut wtxn = env.env().write_txn().unwrap();
        let db = env.env().create_database::<heed::types::Bytes, heed::types::Bytes>(&mut wtxn, None).unwrap();
        for (i, key) in keys.into_iter().enumerate() {
            db.put(&mut wtxn, key, format!("value {i}").as_bytes()).unwrap();
        }
        wtxn.commit().unwrap();
        env.close();
        dir
    }

    /// Keys b"\xfe" and b"\xff" were both served as "\u{FFFD}" (members `�_4.bin`, `�_5.bin`): now every
    /// key of an environment with such a key is its bytes in hex, the UTF-8 ones too.
    #[test]
    fn keys_that_are_not_utf8_make_every_key_of_the_environment_hex() {
        let dir = environment([&b"\xfe"[..], b"\xff", b"a1"]);
        let index = build(dir.path(), &IndexOptions::default(), &NoProgress).unwrap();
        let keys: Vec<&str> = index.samples.iter().map(|s| &*s.key).collect();
        assert_eq!(keys, ["6131", "fe", "ff"]);
        let dir = environment([&b"b"[..], b"a1"]);
        let index = build(dir.path(), &IndexOptions::default(), &NoProgress).unwrap();
        assert_eq!(index.samples.iter().map(|s| &*s.key).collect::<Vec<_>>(), ["a1", "b"]);
    }

    const PAGE: usize = 4096;

    /// An environment like the reviewer's (`gen --format lmdb --samples 300 --mean-bytes 100`): 300 keys of
    /// values from 20 to 200 bytes, and every 50th of 9000 bytes (an overflow run), in a tree of two levels
    /// whose current meta page is page 1. Its `data.mdb`'s bytes.
    fn two_levels() -> (tempfile::TempDir, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let env = LmdbEnv::create(dir.path(), 4 << 20, 0).unwrap();
        let mut wtxn = env.env().write_txn().unwrap();
        let db = env.env().create_database::<heed::types::Bytes, heed::types::Bytes>(&mut wtxn, None).unwrap();
        for i in 0..300u32 {
            let len = if i % 50 == 49 { 9000 } else { 20 + (i as usize * 37) % 180 };
            db.put(&mut wtxn, format!("{i:08}").as_bytes(), &vec![i as u8; len]).unwrap();
        }
        wtxn.commit().unwrap();
        env.close();
        let bytes = std::fs::read(dir.path().join("data.mdb")).unwrap();
        assert_eq!(u32_at(&bytes, 40) as usize, PAGE, "the tests patch pages of 4096 bytes");
        assert_eq!(u16_at(&bytes, PAGE + 88 + 6), 2, "a tree of two levels");
        (dir, bytes)
    }

    fn u16_at(bytes: &[u8], at: usize) -> u16 {
        u16::from_le_bytes(bytes[at..at + 2].try_into().unwrap())
    }

    fn u32_at(bytes: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
    }

    fn u64_at(bytes: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
    }

    fn put16(bytes: &mut [u8], at: usize, value: u16) {
        bytes[at..at + 2].copy_from_slice(&value.to_le_bytes());
    }

    /// The main database's root (a branch page) in the current meta page (page 1).
    fn root(bytes: &[u8]) -> usize {
        u64_at(bytes, PAGE + 88 + 40) as usize
    }

    /// The page of the root's last child: a leaf.
    fn last_leaf(bytes: &[u8]) -> usize {
        let at = root(bytes) * PAGE;
        let nodes = (usize::from(u16_at(bytes, at + 12)) - 16) / 2;
        let node = at + usize::from(u16_at(bytes, at + 16 + 2 * (nodes - 1)));
        let child = u64::from(u16_at(bytes, node)) | u64::from(u16_at(bytes, node + 2)) << 16;
        assert_eq!(u16_at(bytes, child as usize * PAGE + 10), 0x02, "a leaf");
        child as usize
    }

    /// Indexes `bytes` as the `data.mdb` of `dir`: the error's text, or the number of samples.
    fn index_bytes(dir: &tempfile::TempDir, bytes: &[u8]) -> Result<usize, String> {
        std::fs::write(dir.path().join("data.mdb"), bytes).unwrap();
        build(dir.path(), &IndexOptions::default(), &NoProgress).map(|i| i.samples.len()).map_err(|e| e.to_string())
    }

    fn refused(dir: &tempfile::TempDir, bytes: &[u8], expected: &str) {
        let err = index_bytes(dir, bytes).expect_err("a damaged data.mdb is refused");
        assert!(err.contains("data.mdb is damaged: ") && err.contains(expected), "{err}");
    }

    /// Meta page 1 (the current one) of another page size than meta 0's: LMDB used meta 1's, mapped past
    /// the file's end and died of SIGBUS in `mdb_env_pick_meta`.
    #[test]
    fn meta_pages_of_two_page_sizes_are_refused() {
        let (dir, whole) = two_levels();
        assert_eq!(index_bytes(&dir, &whole), Ok(300));
        for size in [8192u32, 65536, 3000] {
            let mut bytes = whole.clone();
            bytes[PAGE + 40..PAGE + 44].copy_from_slice(&size.to_le_bytes());
            let expected = match size {
                3000 | 65536 => format!("page 1: its page size {size} is not a power of two from 512 to 32768"),
                _ => format!("page 1: its page size {size} is not meta page 0's (4096)"),
            };
            refused(&dir, &bytes, &expected);
        }
        let mut bytes = whole.clone();
        bytes[PAGE + 88 + 40..PAGE + 88 + 48].copy_from_slice(&1000u64.to_le_bytes());
        refused(&dir, &bytes, "page 1: the main database's root 1000 is not a page from 2 to the last");
        let mut bytes = whole;
        bytes[PAGE + 20..PAGE + 24].copy_from_slice(&2u32.to_le_bytes());
        refused(&dir, &bytes, "page 1: LMDB data version 2, not 1");
    }

    /// A leaf node near the page's end whose key or overflow page number lies past it (past the file's end
    /// on its last page): LMDB read it (SIGBUS in `mdb_node_read`), and so did the message naming the key.
    #[test]
    fn a_node_running_past_its_page_is_refused() {
        let (dir, whole) = two_levels();
        let leaf = last_leaf(&whole);
        for (flags, key_size) in [(0x01u16, 8u16), (0, 60000)] {
            let mut bytes = whole.clone();
            let node = PAGE - 10;
            put16(&mut bytes, leaf * PAGE + 16, node as u16);
            for (i, field) in [8, 0, flags, key_size].into_iter().enumerate() {
                put16(&mut bytes, leaf * PAGE + node + 2 * i, field);
            }
            refused(&dir, &bytes, &format!("page {leaf}: node 0's key ({key_size} bytes) runs past the page"));
        }
        // An overflow value of 16 MiB at a page that is not an overflow run.
        let mut bytes = whole.clone();
        let node = leaf * PAGE + usize::from(u16_at(&whole, leaf * PAGE + 16));
        let key_size = usize::from(u16_at(&whole, node + 6));
        for (i, field) in [0, 0x100, 0x01].into_iter().enumerate() {
            put16(&mut bytes, node + 2 * i, field);
        }
        bytes[node + 8 + key_size..node + 16 + key_size].copy_from_slice(&(root(&whole) as u64).to_le_bytes());
        refused(&dir, &bytes, &format!("page {leaf}: it points to page {}, reached before", root(&whole)));
        // An inline value longer than the page holds.
        let mut bytes = whole;
        put16(&mut bytes, node + 2, 1);
        refused(&dir, &bytes, &format!("page {leaf}: node 0's value (65"));
    }

    /// A node flagged `F_DUPDATA` in a main database that is not `MDB_DUPSORT`: LMDB dereferenced NULL
    /// (`mdb_xcursor_init1`).
    #[test]
    fn a_node_of_duplicates_in_a_database_of_one_value_a_key_is_refused() {
        let (dir, whole) = two_levels();
        let leaf = last_leaf(&whole);
        let mut bytes = whole.clone();
        let node = leaf * PAGE + usize::from(u16_at(&whole, leaf * PAGE + 16));
        put16(&mut bytes, node + 4, 0x04);
        refused(&dir, &bytes, &format!("page {leaf}: node 0 has flags 0x4, not a value's"));
    }

    /// `levels` branch pages appended above the root, each of `fan` nodes all pointing at the page below (a
    /// DAG, as /tmp/rev-fmt/lmdbdag.py builds): the cursor walked every path, each leaf `fan^levels` times.
    fn shared_branches(whole: &[u8], levels: usize, fan: usize) -> Vec<u8> {
        let mut bytes = whole.to_vec();
        let meta = PAGE + 88;
        let last = u64_at(whole, PAGE + 136) as usize;
        let mut below = root(whole);
        for level in 0..levels {
            let number = last + 1 + level;
            let mut page = vec![0u8; PAGE];
            let mut upper = PAGE;
            for k in 0..fan {
                let key = if k == 0 { Vec::new() } else { format!("{k:04}").into_bytes() };
                let mut node = Vec::new();
                for field in [below & 0xffff, below >> 16, 0, key.len()] {
                    node.extend_from_slice(&(field as u16).to_le_bytes());
                }
                node.extend_from_slice(&key);
                upper -= node.len();
                page[upper..upper + node.len()].copy_from_slice(&node);
                put16(&mut page, 16 + 2 * k, upper as u16);
            }
            page[..8].copy_from_slice(&(number as u64).to_le_bytes());
            put16(&mut page, 10, 0x01);
            put16(&mut page, 12, (16 + 2 * fan) as u16);
            put16(&mut page, 14, upper as u16);
            bytes.extend_from_slice(&page);
            below = number;
        }
        let depth = u16_at(whole, meta + 6) + levels as u16;
        put16(&mut bytes, meta + 6, depth);
        bytes[meta + 40..meta + 48].copy_from_slice(&(below as u64).to_le_bytes());
        bytes[PAGE + 136..PAGE + 144].copy_from_slice(&((last + levels) as u64).to_le_bytes());
        bytes
    }

    /// A tree whose branch pages are shared: 6 levels of 60 made the walk take 5.9 GB and abort; one level
    /// of 2 indexed every sample twice. The walk reaches each page once.
    #[test]
    fn a_tree_of_shared_pages_is_refused() {
        let (dir, whole) = two_levels();
        let last = u64_at(&whole, PAGE + 136) as usize;
        // The walk goes down the first nodes to the bottom level, whose second node reaches the root again.
        let shared = format!("page {}: it points to page {}, reached before", last + 1, root(&whole));
        refused(&dir, &shared_branches(&whole, 1, 2), &shared);
        refused(&dir, &shared_branches(&whole, 6, 60), &shared);
        // One level of one node (no DAG): the tree is sound, but LMDB asserts a branch of two nodes.
        refused(
            &dir,
            &shared_branches(&whole, 1, 1),
            &format!("page {}: it holds 1 nodes, fewer than a branch", last + 1),
        );
        // The main database's record says fewer entries than its leaves hold.
        let mut bytes = whole;
        bytes[PAGE + 88 + 32..PAGE + 88 + 40].copy_from_slice(&299u64.to_le_bytes());
        refused(&dir, &bytes, "holds more than the 299 entries the main database's record says");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Two LMDB keys never become one sample key: an environment is served with every key byte for byte
        /// (in LMDB's order), or, where one is not UTF-8, every key as its bytes in hex.
        #[test]
        fn two_keys_never_become_one(
            keys in btree_set(vec(prop_oneof![b'a'..=b'c', 0x80u8..=0xff, any::<u8>()], 1..4), 1..8),
        ) {
            let dir = environment(keys.iter().map(Vec::as_slice));
            let all_text = keys.iter().all(|k| std::str::from_utf8(k).is_ok());
            let index = build(dir.path(), &IndexOptions::default(), &NoProgress).unwrap();
            let served: Vec<String> = index.samples.iter().map(|s| s.key.to_string()).collect();
            let expected: Vec<String> = keys
                .iter()
                .map(|k| if all_text { String::from_utf8(k.clone()).unwrap() } else { super::hex(k) })
                .collect();
            prop_assert_eq!(&served, &expected);
            let distinct: BTreeSet<&String> = served.iter().collect();
            prop_assert_eq!(distinct.len(), keys.len());
        }

        /// Bytes flipped anywhere in a `data.mdb` (page headers and node headers more often than values)
        /// never crash the process: the environment is refused, or indexed with all of its 300 samples, each
        /// inside the file.
        #[test]
        fn flipped_bytes_never_crash_indexing(
            flips in vec((0usize..64, prop_oneof![0usize..64, 0usize..PAGE], 1u8..=255), 1..4),
        ) {
            let (dir, mut bytes) = two_levels();
            let pages = bytes.len() / PAGE;
            for &(page, offset, xor) in &flips {
                bytes[(page % pages) * PAGE + offset] ^= xor;
            }
            std::fs::write(dir.path().join("data.mdb"), &bytes).unwrap();
            if let Ok(index) = build(dir.path(), &IndexOptions::default(), &NoProgress) {
                prop_assert_eq!(index.samples.len(), 300);
                for sample in &index.samples {
                    prop_assert!(sample.parts[0].offset + sample.parts[0].len <= bytes.len() as u64);
                }
            }
        }
    }
}
