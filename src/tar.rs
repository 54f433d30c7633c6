//! POSIX tar: a streaming member scanner (for WebDataset shards) and a ustar/pax header writer (for tar
//! batch bodies).
//!
//! The scanner understands ustar and GNU headers, pax extended headers (`path`, `size`) and GNU long
//! names (`L`). It yields regular files only, each with the offset and size of its data, and reports a
//! bad header checksum or a member cut short with the byte offset of its header.

use thiserror::Error;

/// Tar block size.
pub const BLOCK: u64 = 512;

/// A tar parsing error at byte `offset` (the start of the offending header).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TarError {
    #[error("bad tar header checksum at byte {offset}")]
    BadChecksum { offset: u64 },
    #[error("tar member {name:?} at byte {offset} is cut short: needs {needed} bytes, {available} remain")]
    Truncated { offset: u64, name: String, needed: u64, available: u64 },
    #[error("bad numeric field {field} in the tar header at byte {offset}")]
    BadNumber { offset: u64, field: &'static str },
    #[error("bad pax extended header at byte {offset}")]
    BadPax { offset: u64 },
    #[error("tar stream ends inside a header at byte {offset}")]
    TruncatedHeader { offset: u64 },
}

/// A regular file found in a tar stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Full member path (bytes that are not UTF-8 shown as U+FFFD: see `unusable`).
    pub name: String,
    /// Why the member's data cannot be a sample's part as the tar stores it, if it cannot: its name is not
    /// UTF-8 (keys are text: decoded lossily, two names became one key), or it is a GNU sparse file (its
    /// stored bytes are not its contents).
    pub unusable: Option<&'static str>,
    /// Offset of the member's header.
    pub header_offset: u64,
    /// Offset of the member's data.
    pub data_offset: u64,
    /// Size of the member's data.
    pub size: u64,
}

/// Rounds `n` up to a whole number of blocks.
pub fn padded(n: u64) -> u64 {
    n.div_ceil(BLOCK) * BLOCK
}

fn parse_number(field: &[u8], offset: u64, name: &'static str) -> Result<u64, TarError> {
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        // GNU base-256: big-endian, first byte's high bit set.
        let mut value: u64 = u64::from(field[0] & 0x7f);
        for &b in &field[1..] {
            value = value.checked_mul(256).ok_or(TarError::BadNumber { offset, field: name })? | u64::from(b);
        }
        return Ok(value);
    }
    let text: Vec<u8> = field.iter().copied().take_while(|&b| b != 0).collect();
    let text = std::str::from_utf8(&text).map_err(|_| TarError::BadNumber { offset, field: name })?.trim();
    if text.is_empty() {
        return Ok(0);
    }
    u64::from_str_radix(text, 8).map_err(|_| TarError::BadNumber { offset, field: name })
}

/// A NUL-ended field as text, and whether it was UTF-8 (else decoded lossily).
fn text(field: &[u8]) -> (String, bool) {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    match std::str::from_utf8(&field[..end]) {
        Ok(text) => (text.to_owned(), true),
        Err(_) => (String::from_utf8_lossy(&field[..end]).into_owned(), false),
    }
}

fn header_checksum(header: &[u8]) -> u64 {
    // The sum of every byte, with the checksum field's 8 counted as spaces (in two plain sums, which the
    // compiler vectorizes).
    let sum = |bytes: &[u8]| bytes.iter().map(|&b| u64::from(b)).sum::<u64>();
    sum(header) - sum(&header[148..156]) + 8 * u64::from(b' ')
}

/// The same sum with the bytes taken as signed, as some old tars (and Sun's) wrote it; GNU tar and Python
/// accept either.
fn signed_header_checksum(header: &[u8]) -> i64 {
    let sum = |bytes: &[u8]| bytes.iter().map(|&b| i64::from(b as i8)).sum::<i64>();
    sum(header) - sum(&header[148..156]) + 8 * i64::from(b' ')
}

/// What a pax extended header says of the header after it.
struct Pax {
    /// The path, and whether it was UTF-8.
    path: Option<(String, bool)>,
    size: Option<u64>,
    /// A GNU sparse file in pax form.
    sparse: bool,
}

/// Walks the members of a tar stream held in memory.
pub struct Scanner<'a> {
    buf: &'a [u8],
    pos: u64,
    done: bool,
}

impl<'a> Scanner<'a> {
    /// Scans `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Scanner { buf, pos: 0, done: false }
    }

    fn block(&self, at: u64) -> Option<&'a [u8]> {
        let start = usize::try_from(at).ok()?;
        self.buf.get(start..start.checked_add(BLOCK as usize)?)
    }

    /// A pax header's path (and whether it was UTF-8), size, and whether it says the member is sparse.
    fn parse_pax(data: &[u8], offset: u64) -> Result<Pax, TarError> {
        let bad = || TarError::BadPax { offset };
        let (mut path, mut size, mut sparse) = (None, None, false);
        let mut rest = data;
        while !rest.is_empty() && rest[0] != 0 {
            let space = rest.iter().position(|&b| b == b' ').ok_or_else(bad)?;
            let len: usize = std::str::from_utf8(&rest[..space]).ok().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
            if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
                return Err(bad());
            }
            let record = &rest[space + 1..len - 1];
            let eq = record.iter().position(|&b| b == b'=').ok_or_else(bad)?;
            let (key, value) = (&record[..eq], &record[eq + 1..]);
            match key {
                b"path" => path = Some(text(value)),
                // GNU's sparse files in pax form: a map of holes precedes the data.
                k if k.starts_with(b"GNU.sparse.") => sparse = true,
                b"size" => size = Some(std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()).ok_or_else(bad)?),
                _ => {}
            }
            rest = &rest[len..];
        }
        Ok(Pax { path, size, sparse })
    }

    fn next_member(&mut self) -> Result<Option<Member>, TarError> {
        let mut long_name: Option<(String, bool)> = None;
        let mut pax_size: Option<u64> = None;
        let mut pax_sparse = false;
        loop {
            let offset = self.pos;
            if offset >= self.buf.len() as u64 {
                return Ok(None); // EOF without end-of-archive blocks: accepted, as GNU tar does.
            }
            let Some(header) = self.block(offset) else {
                return Err(TarError::TruncatedHeader { offset });
            };
            if header.iter().all(|&b| b == 0) {
                return Ok(None); // End of archive.
            }
            let stored = parse_number(&header[148..156], offset, "chksum")?;
            if stored != header_checksum(header) && i64::try_from(stored) != Ok(signed_header_checksum(header)) {
                return Err(TarError::BadChecksum { offset });
            }
            let typeflag = header[156];
            let mut size = parse_number(&header[124..136], offset, "size")?;
            if let Some(s) = pax_size.take() {
                size = s;
            }
            // What a pax header said applies to the header after it only, whatever that is.
            let sparse = std::mem::take(&mut pax_sparse);
            let (mut name, mut utf8) = text(&header[0..100]);
            if &header[257..262] == b"ustar" && header[262] == 0 {
                let (prefix, ok) = text(&header[345..500]);
                if !prefix.is_empty() {
                    (name, utf8) = (format!("{prefix}/{name}"), utf8 && ok);
                }
            }
            if let Some(n) = long_name.take() {
                (name, utf8) = n;
            }
            let mut data_offset = offset + BLOCK;
            // An old GNU sparse file whose map outgrew its header: extension headers (each flagging the
            // next at byte 504) come before its data (taken for its data, they put the next header astray).
            let mut extended = typeflag == b'S' && header[482] != 0;
            while extended {
                let Some(more) = self.block(data_offset) else {
                    return Err(TarError::TruncatedHeader { offset: data_offset });
                };
                (extended, data_offset) = (more[504] != 0, data_offset + BLOCK);
            }
            let available = (self.buf.len() as u64).saturating_sub(data_offset);
            if size > available && matches!(typeflag, b'x' | b'g' | b'L' | b'K') {
                // An extended header cut short is part of the next member's header: its own name
                // (`././@PaxHeader`) is no member's, so whose header it was cannot be known.
                return Err(TarError::TruncatedHeader { offset });
            }
            if size > available {
                return Err(TarError::Truncated { offset, name, needed: size, available });
            }
            self.pos = data_offset + padded(size);
            let data = &self.buf[data_offset as usize..(data_offset + size) as usize];
            match typeflag {
                b'x' => {
                    let pax = Self::parse_pax(data, offset)?;
                    (long_name, pax_size, pax_sparse) = (pax.path, pax.size, pax.sparse);
                }
                b'L' => long_name = Some(text(data)),
                b'0' | 0 | b'7' | b'S' => {
                    let unusable = match (typeflag == b'S' || sparse, utf8) {
                        (true, _) => Some("is a GNU sparse file (its stored bytes are not its contents)"),
                        (_, false) => Some("has a name that is not UTF-8 (keys are text)"),
                        _ => None,
                    };
                    return Ok(Some(Member { name, unusable, header_offset: offset, data_offset, size }));
                }
                _ => {} // Directories, links, global pax headers and the rest hold no sample data.
            }
        }
    }
}

impl Iterator for Scanner<'_> {
    type Item = Result<Member, TarError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.next_member() {
            Ok(Some(m)) => Some(Ok(m)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// `value` in octal, zero-padded to fill `field` but its last byte, which is NUL. (Without `format!`: a
/// manifest writes a header per member, two million at ImageNet's size.)
fn write_octal(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    let mut rest = value;
    for digit in field[..digits].iter_mut().rev() {
        *digit = b'0' + (rest & 7) as u8;
        rest >>= 3;
    }
    assert!(rest == 0, "{value:o} does not fit in {digits} octal digits");
    field[digits] = 0;
}

fn fill_header(header: &mut [u8; 512], name: &[u8], size: u64, typeflag: u8) {
    header[..name.len()].copy_from_slice(name);
    write_octal(&mut header[100..108], 0o644);
    write_octal(&mut header[108..116], 0);
    write_octal(&mut header[116..124], 0);
    if size < 0o777_7777_7777 {
        write_octal(&mut header[124..136], size);
    } else {
        header[124] = 0x80;
        header[128..136].copy_from_slice(&size.to_be_bytes());
    }
    write_octal(&mut header[136..148], 0);
    header[156] = typeflag;
    header[257..263].copy_from_slice(b"ustar\0");
    header[263..265].copy_from_slice(b"00");
    // Six digits, NUL, space.
    let sum = header_checksum(header);
    write_octal(&mut header[148..155], sum);
    header[155] = b' ';
}

/// The header bytes (one ustar block, preceded by a pax block pair when the name is over 100 bytes)
/// for a regular file `name` of `size` bytes. Deterministic: mode 0644, owner 0, mtime 0.
pub fn file_header(name: &str, size: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(BLOCK as usize);
    let bytes = name.as_bytes();
    let short: &[u8] = if bytes.len() <= 100 {
        bytes
    } else {
        // pax record: "<len> path=<name>\n", where <len> counts itself.
        let body = format!(" path={name}\n");
        let mut len = body.len() + 1;
        while format!("{len}").len() + body.len() != len {
            len += 1;
        }
        let record = format!("{len}{body}");
        let mut pax = [0u8; 512];
        fill_header(&mut pax, b"././@PaxHeader", record.len() as u64, b'x');
        out.extend_from_slice(&pax);
        out.extend_from_slice(record.as_bytes());
        out.resize(padded(out.len() as u64) as usize, 0);
        // The ustar name field gets a truncated fallback; readers use the pax path.
        let mut cut = 100;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        &bytes[..cut]
    };
    let mut header = [0u8; 512];
    fill_header(&mut header, short, size, b'0');
    out.extend_from_slice(&header);
    out
}

/// Length of [`file_header`] for a name of `name_len` bytes (independent of the size field's value).
pub fn file_header_len(name: &str) -> u64 {
    file_header(name, 0).len() as u64
}

/// Bytes of zero padding after `size` data bytes.
pub fn padding(size: u64) -> u64 {
    padded(size) - size
}

/// The end-of-archive marker: two zero blocks.
pub const END_LEN: u64 = 2 * BLOCK;

#[cfg(test)]
mod tests {
    use super::*;

    /// An old GNU sparse file whose map outgrew its header has extension headers before its data: the
    /// member is found unusable at its data, and the next member where it is (they were taken for the
    /// sparse file's data, and the rest of the shard for damage).
    #[test]
    fn an_extended_sparse_member_is_unusable_and_the_next_one_found() {
        let mut buf = file_header("b.jpg", 6);
        buf[156] = b'S';
        buf[482] = 1;
        buf[148..156].fill(b' ');
        let sum = header_checksum(&buf);
        write_octal(&mut buf[148..155], sum);
        let mut extension = [0u8; 512];
        extension[504] = 0; // the last extension
        buf.extend_from_slice(&extension);
        buf.extend_from_slice(b"sparse");
        buf.resize(buf.len() + padding(6) as usize, 0);
        buf.extend(file_header("c.jpg", 4));
        buf.extend_from_slice(b"fine");
        buf.resize(buf.len() + padding(4) as usize + END_LEN as usize, 0);
        let members: Vec<Member> = Scanner::new(&buf).collect::<Result<_, _>>().unwrap();
        assert_eq!(members.len(), 2);
        assert!(members[0].unusable.is_some_and(|why| why.contains("sparse")));
        assert_eq!(members[0].data_offset, 1024);
        assert_eq!((members[1].name.as_str(), members[1].data_offset, members[1].unusable), ("c.jpg", 2048, None));
    }
    use proptest::prelude::*;

    fn archive(files: &[(String, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, data) in files {
            out.extend(file_header(name, data.len() as u64));
            out.extend_from_slice(data);
            out.resize(out.len() + padding(data.len() as u64) as usize, 0);
        }
        out.resize(out.len() + END_LEN as usize, 0);
        out
    }

    #[test]
    fn checksum_and_truncation_errors() {
        let mut buf = archive(&[("a.jpg".into(), vec![7; 700]), ("a.cls".into(), b"3".to_vec())]);
        let members: Vec<_> = Scanner::new(&buf).collect::<Result<_, _>>().unwrap();
        assert_eq!(members.len(), 2);
        assert_eq!(members[1].header_offset, 512 + 1024);
        let cut = &buf[..512 + 600];
        assert_eq!(
            Scanner::new(cut).next(),
            Some(Err(TarError::Truncated { offset: 0, name: "a.jpg".into(), needed: 700, available: 600 }))
        );
        buf[512 + 1024 + 10] ^= 1;
        let items: Vec<_> = Scanner::new(&buf).collect();
        assert_eq!(items[1], Err(TarError::BadChecksum { offset: 1536 }));
    }

    /// A pax or GNU long-name header cut short was a member cut short, named `././@PaxHeader`: a name of no
    /// key, so the sample being grouped looked complete and was kept with the member it names missing.
    #[test]
    fn an_extended_header_cut_short_is_a_header_error() {
        let name = format!("{}/sample.jpg", "d".repeat(150));
        let buf = archive(&[("a.jpg".into(), b"xyz".to_vec()), (name, b"xyz".to_vec())]);
        let cut = &buf[..3 * BLOCK as usize + 100];
        let items: Vec<_> = Scanner::new(cut).collect();
        assert_eq!(items.len(), 2, "{items:?}");
        assert_eq!(items[1], Err(TarError::TruncatedHeader { offset: 2 * BLOCK }));
        let mut long = vec![0u8; BLOCK as usize];
        fill_header((&mut long[..]).try_into().unwrap(), b"././@LongLink", 300, b'L');
        long.extend_from_slice(&[b'd'; 100]);
        assert_eq!(Scanner::new(&long).next(), Some(Err(TarError::TruncatedHeader { offset: 0 })));
    }

    #[test]
    fn long_names_use_pax() {
        let name = format!("{}/sample.jpg", "d".repeat(150));
        let buf = archive(&[(name.clone(), b"xyz".to_vec())]);
        let members: Vec<_> = Scanner::new(&buf).collect::<Result<_, _>>().unwrap();
        assert_eq!(members[0].name, name);
        assert_eq!(file_header_len(&name), 3 * BLOCK);
        assert_eq!(file_header_len("short"), BLOCK);
    }

    proptest! {
        #[test]
        fn octal_fields_are_what_format_writes(value in 0u64..0o777_7777_7777, digits in 6usize..12) {
            let value = value % 8u64.pow(digits as u32);
            let mut field = vec![0xffu8; digits + 1];
            write_octal(&mut field, value);
            prop_assert_eq!(field, format!("{value:0digits$o}\0").into_bytes());
        }
    }

    proptest! {
        #[test]
        fn roundtrip(
            files in proptest::collection::vec(
                ("[a-z0-9_/]{1,160}", proptest::collection::vec(any::<u8>(), 0..1500)),
                0..8,
            )
        ) {
            let files: Vec<(String, Vec<u8>)> = files;
            let buf = archive(&files);
            let members: Vec<Member> = Scanner::new(&buf).collect::<Result<_, _>>().unwrap();
            prop_assert_eq!(members.len(), files.len());
            for (m, (name, data)) in members.iter().zip(&files) {
                prop_assert_eq!(&m.name, name);
                prop_assert_eq!(&buf[m.data_offset as usize..(m.data_offset + m.size) as usize], &data[..]);
            }
        }

        #[test]
        fn never_panics(buf in proptest::collection::vec(any::<u8>(), 0..2048)) {
            for m in Scanner::new(&buf) { let _ = m; }
        }
    }
}
