//! HPACK (RFC 7541) header blocks decoded, as the mount reads a server's response heads: the static
//! and dynamic tables, integers, literals and the Huffman code. A connection's bytes are hostile input:
//! every index, length and integer is checked, the dynamic table never grows past the size this side
//! allows (the default 4,096 bytes: the mount announces no other), a size update comes only first in a
//! block, and a Huffman string must end in at most seven bits of padding, all ones, and hold no EOS.
//!
//! **Why not a crate's.** The one the mount used (`loona-hpack`) built a table of maps for every
//! Huffman-coded string and walked it a bit at a time through hash lookups: a response head carries
//! `x-batchfs-checkpoints` (a few hundred bytes, Huffman-coded by the server's encoder), and decoding it
//! was 5 % of the mount daemon's CPU over an epoch (docs/BENCHMARKS.md). The code here is canonical (each
//! length's codes consecutive, in symbol order), so a code is decoded from each length's first code and
//! count alone, with no table built at run time. `loona-hpack` stays the reference the property test and
//! the fuzz target compare against.

use std::borrow::Cow;
use std::collections::VecDeque;

/// The dynamic table's size this side allows when it announces none (SETTINGS_HEADER_TABLE_SIZE).
pub const DEFAULT_TABLE_SIZE: usize = 4096;
/// A table entry's size beyond its name and value (RFC 7541 4.1).
const ENTRY_OVERHEAD: usize = 32;

/// Why a header block does not decode (a COMPRESSION_ERROR of the connection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HpackError {
    #[error("the block ends inside a field")]
    Truncated,
    #[error("an integer past 2^28")]
    Overflow,
    #[error("index {0} is in neither table")]
    Index(usize),
    #[error("a Huffman string {0}")]
    Huffman(&'static str),
    #[error("a table size update to {got} past the {max} allowed")]
    TableSize { got: usize, max: usize },
    #[error("a table size update after a field")]
    LateSizeUpdate,
}

/// A dynamic table entry: a field's name and value.
type Entry = (Box<[u8]>, Box<[u8]>);

/// A connection's HPACK decoder: the dynamic table lives across its header blocks.
pub struct Decoder {
    /// Newest first: index 62 is `table[0]`.
    table: VecDeque<Entry>,
    /// Bytes of the table as RFC 7541 counts them, and the most it may hold now and ever.
    size: usize,
    capacity: usize,
    max: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder::new(DEFAULT_TABLE_SIZE)
    }
}

impl Decoder {
    /// A decoder whose dynamic table may hold `max` bytes (what this side announced).
    pub fn new(max: usize) -> Decoder {
        Decoder { table: VecDeque::new(), size: 0, capacity: max, max }
    }

    /// Decodes `block`, a whole header block, calling `field(name, value)` for each field in order.
    /// An error leaves the table as the fields before it made it: the connection must end.
    pub fn decode(&mut self, block: &[u8], mut field: impl FnMut(&[u8], &[u8])) -> Result<(), HpackError> {
        let mut at = 0;
        let mut fields = 0usize;
        while at < block.len() {
            let first = block[at];
            if first & 0x80 != 0 {
                // Indexed field (6.1).
                let index = integer(block, &mut at, 7)?;
                let (name, value) = self.entry(index)?;
                field(name, value);
            } else if first & 0xc0 == 0x40 {
                // Literal with incremental indexing (6.2.1).
                let index = integer(block, &mut at, 6)?;
                let name: Cow<[u8]> = match index {
                    0 => string(block, &mut at)?,
                    i => Cow::Owned(self.entry(i)?.0.to_vec()),
                };
                let value = string(block, &mut at)?;
                field(&name, &value);
                self.insert(name.into_owned().into(), value.into_owned().into());
            } else if first & 0xe0 == 0x20 {
                // Dynamic table size update (6.3): only before the block's first field.
                if fields > 0 {
                    return Err(HpackError::LateSizeUpdate);
                }
                let got = integer(block, &mut at, 5)?;
                if got > self.max {
                    return Err(HpackError::TableSize { got, max: self.max });
                }
                self.capacity = got;
                self.evict(0);
                continue;
            } else {
                // Literal without indexing (6.2.2) or never indexed (6.2.3).
                let index = integer(block, &mut at, 4)?;
                let value;
                match index {
                    0 => {
                        let name = string(block, &mut at)?;
                        value = string(block, &mut at)?;
                        field(&name, &value);
                    }
                    i => {
                        let name = self.entry(i)?.0;
                        value = string(block, &mut at)?;
                        field(name, &value);
                    }
                }
            }
            fields += 1;
        }
        Ok(())
    }

    /// Entry `index` of the static table (1-61) or the dynamic one (62 on, newest first).
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        match index {
            1..=61 => {
                let (name, value) = STATIC[index - 1];
                Ok((name.as_bytes(), value.as_bytes()))
            }
            i => match i.checked_sub(62).and_then(|k| self.table.get(k)) {
                Some((name, value)) => Ok((name, value)),
                None => Err(HpackError::Index(i)),
            },
        }
    }

    /// Adds a field to the table, evicting the oldest first; one larger than the table empties it.
    fn insert(&mut self, name: Box<[u8]>, value: Box<[u8]>) {
        let size = name.len() + value.len() + ENTRY_OVERHEAD;
        self.evict(size);
        if size <= self.capacity {
            self.size += size;
            self.table.push_front((name, value));
        }
    }

    /// Evicts the oldest entries until `more` bytes fit (or the table is empty).
    fn evict(&mut self, more: usize) {
        while self.size + more > self.capacity {
            let Some((name, value)) = self.table.pop_back() else { break };
            self.size -= name.len() + value.len() + ENTRY_OVERHEAD;
        }
    }
}

/// An integer with an `n`-bit prefix (5.1) at `block[*at]`, `at` moved past it; at most 2^28.
fn integer(block: &[u8], at: &mut usize, n: u32) -> Result<usize, HpackError> {
    let max = (1usize << n) - 1;
    let first = *block.get(*at).ok_or(HpackError::Truncated)? as usize & max;
    *at += 1;
    if first < max {
        return Ok(first);
    }
    let mut value = max;
    let mut shift = 0;
    loop {
        let byte = *block.get(*at).ok_or(HpackError::Truncated)?;
        *at += 1;
        // Past four bytes of seven bits (zeros included: they would shift out of range) is past 2^28.
        if shift > 21 {
            return Err(HpackError::Overflow);
        }
        value += ((byte & 0x7f) as usize) << shift;
        if value > 1 << 28 {
            return Err(HpackError::Overflow);
        }
        if byte & 0x80 == 0 {
            return Ok(value);
        }
        shift += 7;
    }
}

/// A string literal (5.2) at `block[*at]`, `at` moved past it: borrowed where it is plain, decoded where
/// it is Huffman-coded.
fn string<'a>(block: &'a [u8], at: &mut usize) -> Result<Cow<'a, [u8]>, HpackError> {
    let huffman = *block.get(*at).ok_or(HpackError::Truncated)? & 0x80 != 0;
    let len = integer(block, at, 7)?;
    let bytes = block.get(*at..*at + len).ok_or(HpackError::Truncated)?;
    *at += len;
    Ok(if huffman { Cow::Owned(huffman_decode(bytes)?) } else { Cow::Borrowed(bytes) })
}

/// The bits of each symbol's code (RFC 7541 Appendix B), symbol 256 the EOS. The code is canonical:
/// codes of one length are consecutive in symbol order, each length's first code the last length's
/// next, shifted.
#[rustfmt::skip]
const LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28,
    28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6,
    6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8,
    7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7,
    7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23,
    24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22,
    23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25,
    26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24,
    20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27,
    27, 27, 27, 26, 30,
];
/// The longest code.
const MAX_BITS: usize = 30;

/// The canonical code's decoding tables, computed from [`LENGTHS`] at compile time.
struct Canonical {
    /// Per length: its first code, how many codes it has, and where its symbols begin in `symbols`.
    first: [u32; MAX_BITS + 1],
    count: [u32; MAX_BITS + 1],
    offset: [u16; MAX_BITS + 1],
    /// Symbols ordered by (length, symbol).
    symbols: [u16; 257],
}

const CANONICAL: Canonical = canonical();

const fn canonical() -> Canonical {
    let mut count = [0u32; MAX_BITS + 1];
    let mut s = 0;
    while s < 257 {
        count[LENGTHS[s] as usize] += 1;
        s += 1;
    }
    let (mut first, mut offset) = ([0u32; MAX_BITS + 1], [0u16; MAX_BITS + 1]);
    let (mut code, mut placed, mut len) = (0u32, 0u16, 1);
    while len <= MAX_BITS {
        code <<= 1;
        first[len] = code;
        offset[len] = placed;
        code += count[len];
        placed += count[len] as u16;
        len += 1;
    }
    let mut symbols = [0u16; 257];
    let mut next = offset;
    let mut s = 0;
    while s < 257 {
        let l = LENGTHS[s] as usize;
        symbols[next[l] as usize] = s as u16;
        next[l] += 1;
        s += 1;
    }
    Canonical { first, count, offset, symbols }
}

/// The code of `symbol` and its bits (the tests' encoder: the mount writes no Huffman code).
#[cfg(test)]
fn huffman_code(symbol: usize) -> (u32, u8) {
    let len = LENGTHS[symbol] as usize;
    let c = &CANONICAL;
    let rank = c.symbols[c.offset[len] as usize..][..c.count[len] as usize]
        .iter()
        .position(|&s| s as usize == symbol)
        .expect("every symbol has a code of its length");
    (c.first[len] + rank as u32, len as u8)
}

/// Huffman-codes `bytes` (5.2), padded with ones to a whole byte.
#[cfg(test)]
fn huffman_encode(bytes: &[u8]) -> Vec<u8> {
    let (mut out, mut acc, mut bits) = (Vec::with_capacity(bytes.len()), 0u64, 0u32);
    for &b in bytes {
        let (code, len) = huffman_code(b as usize);
        acc = (acc << len) | code as u64;
        bits += len as u32;
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) | ((1 << (8 - bits)) - 1)) as u8);
    }
    out
}

/// Decodes a Huffman-coded string (5.2): each code read a bit at a time and looked up by its length's
/// first code; an EOS, a code past 30 bits, or padding longer than 7 bits or not all ones is an error.
pub fn huffman_decode(bytes: &[u8]) -> Result<Vec<u8>, HpackError> {
    let c = &CANONICAL;
    let mut out = Vec::with_capacity(bytes.len() * 8 / 5);
    let (mut code, mut len) = (0u32, 0usize);
    for &byte in bytes {
        for bit in (0..8).rev() {
            code = (code << 1) | ((byte >> bit) & 1) as u32;
            len += 1;
            let rank = code.wrapping_sub(c.first[len]);
            if rank < c.count[len] {
                let symbol = c.symbols[c.offset[len] as usize + rank as usize];
                if symbol == 256 {
                    return Err(HpackError::Huffman("holds an EOS"));
                }
                out.push(symbol as u8);
                (code, len) = (0, 0);
            } else if len == MAX_BITS {
                return Err(HpackError::Huffman("holds no code of 30 bits or fewer"));
            }
        }
    }
    if len > 7 {
        return Err(HpackError::Huffman("ends in more than 7 bits of padding"));
    }
    if code != (1 << len) - 1 {
        return Err(HpackError::Huffman("ends in padding that is not all ones"));
    }
    Ok(out)
}

/// The static table (RFC 7541 Appendix A): entry `i` is `STATIC[i - 1]`.
const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frames::integer;
    use proptest::prelude::*;

    fn decoded(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, HpackError> {
        let mut out = Vec::new();
        d.decode(block, |n, v| out.push((String::from_utf8_lossy(n).into(), String::from_utf8_lossy(v).into())))?;
        Ok(out)
    }

    fn reference(d: &mut loona_hpack::Decoder<'static>, block: &[u8]) -> Option<Vec<(String, String)>> {
        let mut out = Vec::new();
        d.decode_with_cb(block, |n, v| {
            out.push((String::from_utf8_lossy(&n).into(), String::from_utf8_lossy(&v).into()))
        })
        .ok()?;
        Some(out)
    }

    /// RFC 7541 C.4: three requests on one connection, Huffman-coded, the table carried between them.
    #[test]
    fn the_rfcs_huffman_requests_decode_with_their_table() {
        let hex = |s: &str| {
            (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect::<Vec<u8>>()
        };
        let mut d = Decoder::default();
        let first = decoded(&mut d, &hex("828684418cf1e3c2e5f23a6ba0ab90f4ff")).unwrap();
        let want = [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")];
        assert_eq!(first, want.map(|(n, v)| (n.to_owned(), v.to_owned())));
        assert_eq!(d.size, 57);
        let second = decoded(&mut d, &hex("828684be5886a8eb10649cbf")).unwrap();
        assert_eq!(second.last().unwrap(), &("cache-control".to_owned(), "no-cache".to_owned()));
        assert_eq!(second[3], (":authority".to_owned(), "www.example.com".to_owned()));
        assert_eq!(d.size, 110);
        let third = decoded(&mut d, &hex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf")).unwrap();
        assert_eq!(third[1..3], [(":scheme".into(), "https".into()), (":path".into(), "/index.html".into())]);
        assert_eq!(third[4], ("custom-key".to_owned(), "custom-value".to_owned()));
        assert_eq!(d.size, 164);
    }

    /// Entries count their name, value and 32 bytes; the oldest go first, exactly when the next would not
    /// fit; one larger than the table empties it.
    #[test]
    fn the_dynamic_table_evicts_the_oldest_at_its_exact_size() {
        let mut d = Decoder::default();
        // Size 100, then three literals with incremental indexing of 9 + 9 bytes (50 each).
        let add = |name: &[u8; 9]| [&[0x40, 9][..], name, &[9], b"123456789"].concat();
        let block = [&[0x3f, 0x45][..], &add(b"aaaaaaaaa"), &add(b"bbbbbbbbb")].concat();
        decoded(&mut d, &block).unwrap();
        assert_eq!((d.table.len(), d.size), (2, 100));
        decoded(&mut d, &add(b"ccccccccc")).unwrap();
        assert_eq!((d.table.len(), d.size), (2, 100));
        // 62 is the newest, 63 the one before; the first is gone.
        assert_eq!(decoded(&mut d, &[0xbe, 0xbf]).unwrap()[1].0, "bbbbbbbbb");
        assert_eq!(d.decode(&[0xc0], |_, _| {}), Err(HpackError::Index(64)));
        // 101 bytes: larger than the table, which it empties.
        decoded(&mut d, &[&[0x40, 10][..], b"dddddddddd", &[59], &[b'v'; 59]].concat()).unwrap();
        assert_eq!((d.table.len(), d.size), (0, 0));
    }

    #[test]
    fn the_canonical_code_is_the_rfcs() {
        // Spot checks against Appendix B: '0' is 00000, 'a' 00011, ' ' 010100, EOS 30 ones.
        assert_eq!(huffman_code(b'0' as usize), (0b00000, 5));
        assert_eq!(huffman_code(b'a' as usize), (0b00011, 5));
        assert_eq!(huffman_code(b' ' as usize), (0b010100, 6));
        assert_eq!(huffman_code(256), ((1 << 30) - 1, 30));
        assert_eq!(
            huffman_encode(b"www.example.com"),
            [0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff]
        );
    }

    #[test]
    fn bad_blocks_are_errors_that_say_why() {
        let mut d = Decoder::default();
        assert_eq!(d.decode(&[0x80], |_, _| {}), Err(HpackError::Index(0)));
        assert_eq!(d.decode(&[0xbe], |_, _| {}), Err(HpackError::Index(62)));
        assert_eq!(d.decode(&[0x40, 0x05, b'a'], |_, _| {}), Err(HpackError::Truncated));
        assert_eq!(d.decode(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x7f], |_, _| {}), Err(HpackError::Overflow));
        // Continuation bytes that add nothing still end: a fifth is too many.
        assert_eq!(
            d.decode(&[0xff, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01], |_, _| {}),
            Err(HpackError::Overflow)
        );
        assert_eq!(d.decode(&[0xff, 0x80, 0x80, 0x80, 0x01], |_, _| {}), Err(HpackError::Index(127 + (1 << 21))));
        // A table size update to the most allowed, then past it; one after a field.
        let update = |size| {
            let mut out = Vec::new();
            integer(&mut out, 0x20, 5, size);
            out
        };
        assert_eq!(d.decode(&update(4096), |_, _| {}), Ok(()));
        assert_eq!(d.decode(&update(4097), |_, _| {}), Err(HpackError::TableSize { got: 4097, max: 4096 }));
        assert_eq!(d.decode(&[&[0x82][..], &update(0)].concat(), |_, _| {}), Err(HpackError::LateSizeUpdate));
        // A value whose Huffman code holds the EOS (30 ones and two of padding).
        let eos = [0x00, 0x01, b'x', 0x84, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(d.decode(&eos, |_, _| {}), Err(HpackError::Huffman("holds an EOS")));
        // Padding of more than 7 bits, and padding with a zero.
        assert_eq!(huffman_decode(&[0x1f, 0xff]), Err(HpackError::Huffman("ends in more than 7 bits of padding")));
        assert_eq!(huffman_decode(&[0x00]), Err(HpackError::Huffman("ends in padding that is not all ones")));
    }

    /// One representation of a field in a block, as an encoder may write it.
    #[derive(Debug, Clone)]
    enum Rep {
        Indexed(usize),
        Literal { kind: u8, name_index: usize, name: Vec<u8>, value: Vec<u8>, huffman: (bool, bool) },
        SizeUpdate(usize),
    }

    fn put_str(out: &mut Vec<u8>, s: &[u8], huffman: bool) {
        if huffman {
            let h = huffman_encode(s);
            integer(out, 0x80, 7, h.len());
            out.extend_from_slice(&h);
        } else {
            integer(out, 0, 7, s.len());
            out.extend_from_slice(s);
        }
    }

    fn block(reps: &[Rep]) -> Vec<u8> {
        let mut out = Vec::new();
        for rep in reps {
            match rep {
                Rep::Indexed(i) => integer(&mut out, 0x80, 7, *i),
                Rep::SizeUpdate(s) => integer(&mut out, 0x20, 5, *s),
                Rep::Literal { kind, name_index, name, value, huffman } => {
                    let (first, n) = match kind % 3 {
                        0 => (0x40, 6),
                        1 => (0x00, 4),
                        _ => (0x10, 4),
                    };
                    integer(&mut out, first, n, *name_index);
                    if *name_index == 0 {
                        put_str(&mut out, name, huffman.0);
                    }
                    put_str(&mut out, value, huffman.1);
                }
            }
        }
        out
    }

    /// A field: indexed (now and then past the static table, into the dynamic one the block's literals
    /// fill, or past both), or a literal of any kind, its name indexed or not, either string Huffman-coded
    /// or not.
    fn field() -> impl Strategy<Value = Rep> {
        let text = prop::collection::vec(any::<u8>(), 0..40);
        prop_oneof![
            (1usize..72).prop_map(Rep::Indexed),
            (any::<u8>(), prop_oneof![Just(0usize), 1usize..66], text.clone(), text, any::<(bool, bool)>()).prop_map(
                |(kind, name_index, name, value, huffman)| Rep::Literal { kind, name_index, name, value, huffman }
            ),
        ]
    }

    /// A header block: now and then a table size update first (within the size allowed), then at least
    /// one field (the reference refuses a block that ends in a size update).
    fn header_block() -> impl Strategy<Value = Vec<Rep>> {
        (prop::option::of(0usize..=DEFAULT_TABLE_SIZE), prop::collection::vec(field(), 1..12))
            .prop_map(|(update, fields)| update.map(Rep::SizeUpdate).into_iter().chain(fields).collect())
    }

    proptest! {
        /// Blocks of every representation, Huffman-coded or not, over one connection's table, decoded as
        /// the reference decodes them: every block the reference takes is taken, to the same fields
        /// (until a block neither takes: an index past both tables ends the connection).
        #[test]
        fn blocks_decode_as_the_reference_decodes_them(
            blocks in prop::collection::vec(header_block(), 1..6),
        ) {
            let (mut ours, mut theirs) = (Decoder::default(), loona_hpack::Decoder::new());
            for reps in &blocks {
                let bytes = block(reps);
                let got = decoded(&mut ours, &bytes);
                match reference(&mut theirs, &bytes) {
                    Some(want) => prop_assert_eq!(got, Ok(want)),
                    None => {
                        prop_assert!(got.is_err(), "a block the reference refuses, taken: {:?}", got);
                        break;
                    }
                }
            }
        }

        /// A block that ends anywhere is refused or decodes to the first of its fields, never a panic or a
        /// field past its end.
        #[test]
        fn a_block_cut_anywhere_is_refused_or_decodes_its_first_fields(
            reps in header_block(),
            cut in any::<prop::sample::Index>(),
        ) {
            let bytes = block(&reps);
            let cut = cut.index(bytes.len() + 1);
            let whole = decoded(&mut Decoder::default(), &bytes);
            if let (Ok(part), Ok(whole)) = (decoded(&mut Decoder::default(), &bytes[..cut]), whole) {
                prop_assert!(whole.starts_with(&part), "{:?} is not the start of {:?}", part, whole);
            }
        }

        #[test]
        fn huffman_strings_round_trip(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            prop_assert_eq!(huffman_decode(&huffman_encode(&bytes)).unwrap(), bytes);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = Decoder::default().decode(&bytes, |_, _| {});
            let _ = huffman_decode(&bytes);
        }
    }
}
