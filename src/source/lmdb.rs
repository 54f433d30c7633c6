//! An LMDB environment's indexing (`data.mdb`): its main database's values located in the file by
//! LMDB's own mapping and checked byte for byte, a file cut short refused, named databases left out
//! (refused where they hold every sample). A sample's key is its LMDB key byte for byte, or, in an
//! environment with a key that is not UTF-8, every key's bytes in hex (keys are text; read lossily, two
//! keys became one).

use super::{io_err, Files, IndexError, Progress};
use crate::index::{Exts, Index, Part, Parts, Sample, NO_LABEL};
use crate::mmap::{LmdbEnv, MappedFile};
use crate::{crc, proto};
use std::path::Path;

/// The bytes an LMDB file's last committed transaction uses, from its two meta pages (pages 0 and 1; the one
/// of the larger transaction id is current): `(last page + 1) × page size`. `None` where the first meta page
/// is not LMDB's (LMDB itself then says what is wrong). Layout (64-bit LMDB 0.9): a page header of 16 bytes,
/// then the meta's magic (`0xBEEFC0DE`), version, address and map size, two 48-byte database records (the
/// first's first field holds the page size), the last page number (at 136) and the transaction id (at 144).
pub(super) fn needed_bytes(file: &[u8]) -> Option<u64> {
    let (at, page) = current_meta(file)?;
    word(file, at + 136)?.checked_add(1)?.checked_mul(page)
}

/// The main database's flags (`MDB_DUPSORT`...) in the current meta page: the second database record's
/// (after the first at 40), past its 4-byte pad.
fn main_db_flags(file: &[u8]) -> Option<u16> {
    let (at, _) = current_meta(file)?;
    let at = usize::try_from(at + 40 + 48 + 4).ok()?;
    Some(u16::from_le_bytes(file.get(at..at + 2)?.try_into().ok()?))
}

/// The main database may hold several values under one key (`MDB_DUPSORT` in LMDB's `mdb.c`).
const MDB_DUPSORT: u16 = 0x04;

fn word(file: &[u8], at: u64) -> Option<u64> {
    let at = usize::try_from(at).ok()?;
    Some(u64::from_le_bytes(file.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// Where the current meta page is, and the page size.
fn current_meta(file: &[u8]) -> Option<(u64, u64)> {
    let magic = u32::from_le_bytes(file.get(16..20)?.try_into().ok()?);
    let page = u64::from(u32::from_le_bytes(file.get(40..44)?.try_into().ok()?));
    if magic != 0xBEEF_C0DE || !(512..=1 << 16).contains(&page) {
        return None;
    }
    let txn = |at: u64| word(file, at + 144);
    match (txn(0), txn(page)) {
        (Some(a), Some(b)) if b > a => Some((page, page)),
        (Some(_), _) => Some((0, page)),
        (None, _) => None,
    }
}

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
    if main_db_flags(ours.bytes()).is_some_and(|f| f & MDB_DUPSORT != 0) {
        // Read as one value a key, a key's values were its sub-page's bytes, or left out as if a named
        // database; a sample's key would not name one sample either.
        return Err(refuse(
            "its main database keeps several values under one key (MDB_DUPSORT), which batchfs does not \
             serve: one value per key, as Caffe and most loaders write"
                .into(),
        ));
    }
    // Before LMDB maps it: a page past the end of a file cut short is a SIGBUS, not an error.
    if let Some(needed) = needed_bytes(ours.bytes()).filter(|&n| n > ours.len()) {
        return Err(IndexError::Lmdb {
            path: root.to_owned(),
            message: format!(
                "data.mdb is {} bytes, but its last transaction uses {needed}: the file is truncated (copied in \
                 part, or still being written)",
                ours.len()
            ),
        });
    }
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
    }
}
