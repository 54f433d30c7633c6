//! A read-only walk over `data.mdb`'s bytes, in Rust, before LMDB's C code reads them: LMDB trusts its
//! file, so a damaged one crashed the whole process (SIGBUS past the file's end, a NULL dereference, a
//! walk that revisits shared pages until memory runs out) instead of failing an index.
//!
//! What is checked (LMDB 0.9's 64-bit layout, `mdb.c` in `lmdb-master-sys` the authority):
//! - both meta pages (0, and 1 at meta 0's page size, where LMDB reads it) are meta pages of LMDB's magic
//!   and version 1 and give one page size, a power of two from 512 to LMDB's 32 KiB; the current one (of
//!   the larger transaction id, meta 0 on a tie, as `mdb_env_pick_meta`) has its main database's root
//!   within its last page and a depth from 1 to LMDB's cursor stack of 32 (or no root and no entries);
//! - the main database's B-tree, from that root: every page number at most the last page (so inside the
//!   file: the caller has refused a file shorter than its last page) and reached once (a page shared by
//!   two branches made the walk revisit it, without end), pages of the level's kind (branch above the
//!   depth, leaf at it), page bounds (`mp_lower`, `mp_upper`) and node offsets inside the page, a
//!   branch of two nodes at least (LMDB asserts it) and a leaf of one, each node's key inside its page;
//!   a leaf node's value inside its page, or (`F_BIGDATA`) its overflow run inside the last page with
//!   room for the value, or (`F_SUBDATA`) a named database's 48-byte record; no other node flag (a
//!   main database that is not `MDB_DUPSORT`: `F_DUPDATA` made LMDB dereference NULL);
//! - the leaves hold as many entries as the main database's record says.
//!
//! The walk visits each page once: its cost is one read of the tree's pages, and its memory a bit a
//! page of the file.

use std::fmt;

const PAGE_HEADER: usize = 16;
const NODE_HEADER: usize = 8;
const P_BRANCH: u16 = 0x01;
const P_LEAF: u16 = 0x02;
const P_OVERFLOW: u16 = 0x04;
const P_META: u16 = 0x08;
const P_LEAF2: u16 = 0x20;
const P_SUBP: u16 = 0x40;
/// The flags that say what a page is (the others, `P_DIRTY`, `P_LOOSE`, `P_KEEP`, are a writer's).
const P_KIND: u16 = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP;
const F_BIGDATA: u16 = 0x01;
const F_SUBDATA: u16 = 0x02;
/// The size of a named database's record (`MDB_db`), a `F_SUBDATA` node's value.
const DB_RECORD: u64 = 48;
const MDB_MAGIC: u32 = 0xBEEF_C0DE;
const MDB_DATA_VERSION: u32 = 1;
/// LMDB's largest page (`MAX_PAGESIZE`, without `MDB_DEVEL`).
const MAX_PAGE: u64 = 0x8000;
/// LMDB's cursor stack (`CURSOR_STACK`): a tree deeper than this is not walked.
const CURSOR_STACK: u16 = 32;
/// An empty database's root (`P_INVALID`).
const NO_ROOT: u64 = u64::MAX;

/// What is wrong with a `data.mdb`: on which page, if one, and what.
#[derive(Debug, PartialEq, Eq)]
pub struct Damage {
    page: Option<u64>,
    what: String,
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.page {
            Some(page) => write!(f, "data.mdb is damaged: page {page}: {}", self.what),
            None => write!(f, "data.mdb is damaged: {}", self.what),
        }
    }
}

impl std::error::Error for Damage {}

fn damage(page: Option<u64>, what: impl Into<String>) -> Damage {
    Damage { page, what: what.into() }
}

/// The current meta page's fields that the walk and the caller use.
#[derive(Debug, Clone, Copy)]
pub(in crate::source) struct Meta {
    /// Its page number (0 or 1).
    pub number: u64,
    pub page_size: u64,
    pub last_page: u64,
    /// The main database's flags (`MDB_DUPSORT`...), depth, entries and root.
    pub main_flags: u16,
    depth: u16,
    entries: u64,
    root: u64,
}

fn u16_at(file: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(file.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn u32_at(file: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(file.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn u64_at(file: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(file.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// Meta page `number` at byte `at`: a page header, then the magic, version, address and map size, the
/// free and main databases' 48-byte records (the free one's first field the page size), the last page
/// number (at 136) and the transaction id (at 144).
fn meta_at(file: &[u8], number: u64, at: usize) -> Result<(Meta, u64), Damage> {
    let here = Some(number);
    let txn = u64_at(file, at + 144).ok_or_else(|| damage(here, "the file ends inside this meta page"))?;
    let field16 = |off| u16_at(file, at + off).unwrap_or(0);
    let field32 = |off| u32_at(file, at + off).unwrap_or(0);
    let field64 = |off| u64_at(file, at + off).unwrap_or(0);
    if field16(10) & P_META == 0 {
        return Err(damage(here, format!("not a meta page (its flags are {:#x})", field16(10))));
    }
    if field32(16) != MDB_MAGIC {
        return Err(damage(here, format!("not LMDB's meta page (its magic is {:#010x})", field32(16))));
    }
    if field32(20) != MDB_DATA_VERSION {
        return Err(damage(here, format!("LMDB data version {}, not {MDB_DATA_VERSION}", field32(20))));
    }
    let page_size = u64::from(field32(40));
    if !page_size.is_power_of_two() || !(512..=MAX_PAGE).contains(&page_size) {
        return Err(damage(here, format!("its page size {page_size} is not a power of two from 512 to {MAX_PAGE}")));
    }
    let meta = Meta {
        number,
        page_size,
        last_page: field64(136),
        main_flags: field16(88 + 4),
        depth: field16(88 + 6),
        entries: field64(88 + 32),
        root: field64(88 + 40),
    };
    Ok((meta, txn))
}

/// Both meta pages, checked, and the current one (as LMDB picks it: the larger transaction id, meta 0 on a
/// tie).
pub(in crate::source) fn current_meta(file: &[u8]) -> Result<Meta, Damage> {
    let (first, txn0) = meta_at(file, 0, 0)?;
    let (second, txn1) = meta_at(file, 1, first.page_size as usize)?;
    if first.page_size != second.page_size {
        return Err(damage(
            Some(1),
            format!("its page size {} is not meta page 0's ({})", second.page_size, first.page_size),
        ));
    }
    let meta = if txn0 < txn1 { second } else { first };
    let here = Some(meta.number);
    if meta.last_page < 1 {
        return Err(damage(here, format!("its last page {} is one of the meta pages", meta.last_page)));
    }
    if meta.root == NO_ROOT {
        if meta.entries != 0 {
            return Err(damage(here, format!("the main database has no root but {} entries", meta.entries)));
        }
    } else if !(2..=meta.last_page).contains(&meta.root) {
        return Err(damage(
            here,
            format!("the main database's root {} is not a page from 2 to the last, {}", meta.root, meta.last_page),
        ));
    } else if !(1..=CURSOR_STACK).contains(&meta.depth) {
        return Err(damage(
            here,
            format!("the main database's depth {} is not from 1 to LMDB's {CURSOR_STACK}", meta.depth),
        ));
    }
    Ok(meta)
}

/// Walks the main database's tree of `file` from `meta`'s root; `file` holds at least `meta`'s pages.
pub(in crate::source) fn walk(file: &[u8], meta: &Meta) -> Result<(), Damage> {
    if meta.root == NO_ROOT {
        return Ok(());
    }
    let pages = meta.last_page + 1;
    let needed = pages.checked_mul(meta.page_size).filter(|&n| n <= file.len() as u64);
    if needed.is_none() {
        return Err(damage(Some(meta.number), "its last page lies past the end of the file"));
    }
    let mut walk = Walk {
        file,
        page_size: meta.page_size as usize,
        last_page: meta.last_page,
        depth: meta.depth,
        entries: meta.entries,
        seen: vec![0u64; pages.div_ceil(64) as usize],
        leaves: 0,
    };
    walk.reach(meta.root, meta.number)?;
    walk.visit(meta.root, 1)?;
    if walk.leaves != meta.entries {
        return Err(damage(
            Some(meta.number),
            format!("the main database's record says {} entries, its tree holds {}", meta.entries, walk.leaves),
        ));
    }
    Ok(())
}

struct Walk<'a> {
    file: &'a [u8],
    page_size: usize,
    last_page: u64,
    depth: u16,
    entries: u64,
    /// A bit a page: reached already.
    seen: Vec<u64>,
    leaves: u64,
}

impl<'a> Walk<'a> {
    /// Marks page `number` reached (from page `from`), refusing one reached before or past the last.
    fn reach(&mut self, number: u64, from: u64) -> Result<(), Damage> {
        if !(2..=self.last_page).contains(&number) {
            let what = format!("it points to page {number}, not one from 2 to the last, {}", self.last_page);
            return Err(damage(Some(from), what));
        }
        let (word, bit) = ((number / 64) as usize, 1u64 << (number % 64));
        if self.seen[word] & bit != 0 {
            return Err(damage(Some(from), format!("it points to page {number}, reached before in the tree")));
        }
        self.seen[word] |= bit;
        Ok(())
    }

    fn page(&self, number: u64) -> &'a [u8] {
        let at = number as usize * self.page_size;
        &self.file[at..at + self.page_size]
    }

    /// Page `number` at `level` (the root's is 1) and the tree below it.
    fn visit(&mut self, number: u64, level: u16) -> Result<(), Damage> {
        let page = self.page(number);
        let here = Some(number);
        let kind = u16_at(page, 10).unwrap_or(0) & P_KIND;
        let (leaf, expected) = match level == self.depth {
            true => (true, P_LEAF),
            false => (false, P_BRANCH),
        };
        if kind != expected {
            let what = format!(
                "its flags {kind:#x} are not a {} page's ({expected:#x}), as level {level} of the main database's \
                 {} needs",
                kind_name(leaf),
                self.depth
            );
            return Err(damage(here, what));
        }
        let lower = usize::from(u16_at(page, 12).unwrap_or(0));
        let upper = usize::from(u16_at(page, 14).unwrap_or(0));
        if lower < PAGE_HEADER || lower > upper || upper > self.page_size {
            let what = format!("its bounds {lower}..{upper} are not within its {} bytes", self.page_size);
            return Err(damage(here, what));
        }
        let nodes = (lower - PAGE_HEADER) / 2;
        let fewest = if leaf { 1 } else { 2 };
        if nodes < fewest {
            return Err(damage(
                here,
                format!("it holds {nodes} nodes, fewer than a {} page's {fewest}", kind_name(leaf)),
            ));
        }
        for i in 0..nodes {
            let at = usize::from(u16_at(page, PAGE_HEADER + 2 * i).unwrap_or(0));
            if at < lower || at + NODE_HEADER > self.page_size {
                return Err(damage(here, format!("node {i} starts at {at}, not within the page's nodes")));
            }
            let field = |off: usize| u16_at(page, at + off).unwrap_or(0);
            let (lo, hi, flags, key_size) = (field(0), field(2), field(4), usize::from(field(6)));
            let key_end = at + NODE_HEADER + key_size;
            if key_end > self.page_size {
                return Err(damage(here, format!("node {i}'s key ({key_size} bytes) runs past the page")));
            }
            if !leaf {
                let child = u64::from(lo) | u64::from(hi) << 16 | u64::from(flags) << 32;
                self.reach(child, number)?;
                self.visit(child, level + 1)?;
                continue;
            }
            self.leaves += 1;
            if self.leaves > self.entries {
                let what =
                    format!("its tree holds more than the {} entries the main database's record says", self.entries);
                return Err(damage(here, what));
            }
            let size = u64::from(lo) | u64::from(hi) << 16;
            let inline = match flags {
                0 => size,
                F_SUBDATA if size == DB_RECORD => size,
                F_SUBDATA => {
                    let what = format!("node {i} holds a named database's record of {size} bytes, not {DB_RECORD}");
                    return Err(damage(here, what));
                }
                F_BIGDATA => 8,
                _ => {
                    let what = format!(
                        "node {i} has flags {flags:#x}, not a value's (0), an overflow value's ({F_BIGDATA:#x}) or a \
                         named database's ({F_SUBDATA:#x}) in a main database of one value a key"
                    );
                    return Err(damage(here, what));
                }
            };
            if key_end as u64 + inline > self.page_size as u64 {
                return Err(damage(here, format!("node {i}'s value ({inline} bytes) runs past the page")));
            }
            if flags == F_BIGDATA {
                let first = u64_at(page, key_end).unwrap_or(0);
                self.overflow(first, size, number, i)?;
            }
        }
        Ok(())
    }

    /// The overflow run at page `first` holding a value of `size` bytes, for node `node` of page `from`.
    fn overflow(&mut self, first: u64, size: u64, from: u64, node: usize) -> Result<(), Damage> {
        self.reach(first, from)?;
        let page = self.page(first);
        let here = Some(first);
        let kind = u16_at(page, 10).unwrap_or(0) & P_KIND;
        if kind != P_OVERFLOW {
            let what =
                format!("its flags {kind:#x} are not an overflow page's, which node {node} of page {from} needs");
            return Err(damage(here, what));
        }
        let count = u64::from(u32_at(page, 12).unwrap_or(0));
        let room = count.saturating_mul(self.page_size as u64).saturating_sub(PAGE_HEADER as u64);
        if count == 0 || first + count - 1 > self.last_page || room < size {
            let what = format!(
                "its run of {count} pages does not hold a value of {size} bytes within the last page, {}",
                self.last_page
            );
            return Err(damage(here, what));
        }
        for next in first + 1..first + count {
            self.reach(next, first)?;
        }
        Ok(())
    }
}

fn kind_name(leaf: bool) -> &'static str {
    if leaf {
        "leaf"
    } else {
        "branch"
    }
}
