//! The compact forms the index holds its per-sample and per-file data in: a dataset of a million files
//! holds a million of each, so every byte here is a megabyte there.
//!
//! - [`Name`]: a key or a path, a boxed `str` (no spare capacity).
//! - [`ETag`]: an object's entity tag, a single-part upload's MD5 as its 16 bytes.
//! - [`ChunkCrcs`]: a file's chunk CRCs behind a thin pointer, null for a file of one chunk.
//! - [`Ext`]: a part's extension, one string shared by every part with it ([`Exts`]).
//! - [`Parts`]: a sample's parts, a single one inline.
//!
//! Each reads as what it stands for (a `str`, a `[u32]`, a `[Part]`) and gives back exactly what it was
//! made from: the persisted index's bytes do not depend on these forms.

use super::Part;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

/// A name the index holds one of per file or per sample (a path, a key): a boxed `str`, 16 bytes and its
/// text without spare capacity, where a `String` takes 24 and may round its text up. Reads as a `str`,
/// and as a path.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(Box<str>);

impl Name {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl AsRef<std::path::Path> for Name {
    fn as_ref(&self) -> &std::path::Path {
        std::path::Path::new(&*self.0)
    }
}

impl AsRef<std::ffi::OsStr> for Name {
    fn as_ref(&self) -> &std::ffi::OsStr {
        std::ffi::OsStr::new(&*self.0)
    }
}

impl std::borrow::Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl From<&str> for Name {
    fn from(text: &str) -> Self {
        Name(text.into())
    }
}

impl From<String> for Name {
    fn from(text: String) -> Self {
        Name(text.into_boxed_str())
    }
}

impl From<std::borrow::Cow<'_, str>> for Name {
    fn from(text: std::borrow::Cow<'_, str>) -> Self {
        Name(text.into())
    }
}

impl From<Name> for String {
    fn from(name: Name) -> Self {
        name.0.into()
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        *self.0 == *other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<Name> for str {
    fn eq(&self, other: &Name) -> bool {
        *self == *other.0
    }
}

impl PartialEq<Name> for &str {
    fn eq(&self, other: &Name) -> bool {
        **self == *other.0
    }
}

impl PartialEq<Name> for String {
    fn eq(&self, other: &Name) -> bool {
        **self == *other.0
    }
}

impl PartialOrd<str> for Name {
    fn partial_cmp(&self, other: &str) -> Option<std::cmp::Ordering> {
        (*self.0).partial_cmp(other)
    }
}

impl PartialOrd<String> for Name {
    fn partial_cmp(&self, other: &String) -> Option<std::cmp::Ordering> {
        (*self.0).partial_cmp(&**other)
    }
}

/// An object's entity tag, held compactly: a single-part upload's (an MD5 in lowercase hex, quoted:
/// 34 characters) as its 16 bytes, any other (a multipart upload's, a store's own kind, none) as its
/// text. It reads back as the exact string it was made from ([`fmt::Display`]), for `If-Match`, for
/// comparisons, and in the persisted index.
#[derive(Clone, PartialEq, Eq)]
pub struct ETag(ETagRepr);

/// Invariant: `Text` never holds what `Md5` would (so the derived equality is the strings').
#[derive(Clone, PartialEq, Eq)]
enum ETagRepr {
    Md5([u8; 16]),
    Text(Box<str>),
}

impl ETag {
    /// The tag whose text is `text`.
    pub fn new(text: &str) -> ETag {
        match quoted_md5(text) {
            Some(md5) => ETag(ETagRepr::Md5(md5)),
            None => ETag(ETagRepr::Text(text.into())),
        }
    }

    /// No tag (a local file's).
    pub fn is_empty(&self) -> bool {
        matches!(&self.0, ETagRepr::Text(text) if text.is_empty())
    }

    /// The digest this tag is, where it is a quoted MD5 in lowercase hex.
    pub fn md5(&self) -> Option<[u8; 16]> {
        match self.0 {
            ETagRepr::Md5(md5) => Some(md5),
            ETagRepr::Text(_) => None,
        }
    }

    /// Whether this tag's text is `text`.
    fn is(&self, text: &str) -> bool {
        match &self.0 {
            ETagRepr::Md5(md5) => quoted_md5(text) == Some(*md5),
            ETagRepr::Text(own) => **own == *text,
        }
    }

    /// The length of the tag's text.
    pub fn len(&self) -> usize {
        match &self.0 {
            ETagRepr::Md5(_) => MD5_TAG_LEN,
            ETagRepr::Text(text) => text.len(),
        }
    }
}

/// The text of an MD5 tag: 32 hex digits, quoted.
const MD5_TAG_LEN: usize = 34;
const HEX: &[u8; 16] = b"0123456789abcdef";

/// `byte` as two lower-case hex digits.
pub fn hex_pair(byte: u8) -> [u8; 2] {
    [HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 15)]]
}

/// The digest `text` is the tag of, where it is one as [`ETag`] holds it: exactly a quote, 32 lowercase
/// hex digits and a quote (any other spelling is kept as text, so that it reads back as it was).
fn quoted_md5(text: &str) -> Option<[u8; 16]> {
    let hex = text.strip_prefix('"')?.strip_suffix('"')?.as_bytes();
    if hex.len() != 32 {
        return None;
    }
    let digit = |c: u8| HEX.iter().position(|&h| h == c).map(|d| d as u8);
    let mut md5 = [0u8; 16];
    for (byte, pair) in md5.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(md5)
}

impl Default for ETag {
    fn default() -> Self {
        ETag(ETagRepr::Text(Box::default()))
    }
}

impl fmt::Display for ETag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            ETagRepr::Md5(md5) => {
                let mut text = [b'"'; MD5_TAG_LEN];
                for (pair, byte) in text[1..MD5_TAG_LEN - 1].chunks_exact_mut(2).zip(md5) {
                    pair.copy_from_slice(&hex_pair(*byte));
                }
                f.write_str(std::str::from_utf8(&text).expect("hex digits and quotes"))
            }
            ETagRepr::Text(text) => f.write_str(text),
        }
    }
}

impl fmt::Debug for ETag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.to_string(), f)
    }
}

impl From<&str> for ETag {
    fn from(text: &str) -> Self {
        ETag::new(text)
    }
}

impl From<String> for ETag {
    fn from(text: String) -> Self {
        match quoted_md5(&text) {
            Some(md5) => ETag(ETagRepr::Md5(md5)),
            None => ETag(ETagRepr::Text(text.into_boxed_str())),
        }
    }
}

impl PartialEq<str> for ETag {
    fn eq(&self, other: &str) -> bool {
        self.is(other)
    }
}

impl PartialEq<&str> for ETag {
    fn eq(&self, other: &&str) -> bool {
        self.is(other)
    }
}

impl PartialEq<String> for ETag {
    fn eq(&self, other: &String) -> bool {
        self.is(other)
    }
}

impl PartialEq<ETag> for String {
    fn eq(&self, other: &ETag) -> bool {
        other.is(self)
    }
}

impl PartialEq<ETag> for str {
    fn eq(&self, other: &ETag) -> bool {
        other.is(self)
    }
}

/// The CRC32C of each chunk of a file ([`ShardInfo::chunks`](super::ShardInfo::chunks)), read as a
/// `[u32]`: behind a thin pointer, null where there are none (a file of one chunk: most files of a
/// tree), so that each file pays 8 bytes for the list it seldom has.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ChunkCrcs(Option<Box<Box<[u32]>>>);

impl ChunkCrcs {
    /// The CRCs, in chunk order.
    pub fn as_slice(&self) -> &[u32] {
        self.0.as_deref().map_or(&[], |crcs| crcs)
    }
}

impl std::ops::Deref for ChunkCrcs {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        self.as_slice()
    }
}

impl fmt::Debug for ChunkCrcs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl From<Vec<u32>> for ChunkCrcs {
    fn from(crcs: Vec<u32>) -> Self {
        ChunkCrcs((!crcs.is_empty()).then(|| Box::new(crcs.into_boxed_slice())))
    }
}

impl FromIterator<u32> for ChunkCrcs {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<u32>>().into()
    }
}

impl<'a> IntoIterator for &'a ChunkCrcs {
    type Item = &'a u32;
    type IntoIter = std::slice::Iter<'a, u32>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// A part's extension: a string shared by every part of a dataset with that extension ([`Exts`] hands
/// them out), behind a thin pointer (8 bytes a part). Reads as a `str`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ext(Arc<Box<str>>);

impl Ext {
    /// The extension.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Ext {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for Ext {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Ext {
    /// An extension of its own (not shared: [`Exts::get`] shares them).
    fn from(ext: &str) -> Self {
        Ext(Arc::new(ext.into()))
    }
}

impl fmt::Display for Ext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Ext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self.0, f)
    }
}

impl PartialEq<str> for Ext {
    fn eq(&self, other: &str) -> bool {
        **self.0 == *other
    }
}

impl PartialEq<&str> for Ext {
    fn eq(&self, other: &&str) -> bool {
        **self.0 == **other
    }
}

/// Hands out one shared [`Ext`] per distinct extension (a dataset has a handful), so that a million
/// parts hold a handful of strings.
#[derive(Debug, Default)]
pub struct Exts(HashSet<Ext>);

impl Exts {
    /// The shared [`Ext`] for `ext`.
    pub fn get(&mut self, ext: &str) -> Ext {
        if let Some(shared) = self.0.get(ext) {
            return shared.clone();
        }
        let shared = Ext::from(ext);
        self.0.insert(shared.clone());
        shared
    }
}

/// A sample's parts, in order, read as a `[Part]`: a single part (a file of a tree, a record, a value:
/// most samples) is held inline, several (or none) in a boxed slice.
#[derive(Clone, PartialEq, Eq)]
pub struct Parts(PartsRepr);

/// Invariant: `Many` never holds exactly one part (so the derived equality is the slices').
#[derive(Clone, PartialEq, Eq)]
enum PartsRepr {
    One(Part),
    Many(Box<[Part]>),
}

impl Parts {
    /// The parts, in order.
    pub fn as_slice(&self) -> &[Part] {
        match &self.0 {
            PartsRepr::One(part) => std::slice::from_ref(part),
            PartsRepr::Many(parts) => parts,
        }
    }
}

impl Default for Parts {
    fn default() -> Self {
        Parts(PartsRepr::Many(Box::default()))
    }
}

impl std::ops::Deref for Parts {
    type Target = [Part];

    fn deref(&self) -> &[Part] {
        self.as_slice()
    }
}

impl fmt::Debug for Parts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl From<Part> for Parts {
    fn from(part: Part) -> Self {
        Parts(PartsRepr::One(part))
    }
}

impl From<Vec<Part>> for Parts {
    fn from(mut parts: Vec<Part>) -> Self {
        match parts.len() {
            1 => Parts(PartsRepr::One(parts.pop().expect("one part"))),
            _ => Parts(PartsRepr::Many(parts.into_boxed_slice())),
        }
    }
}

impl FromIterator<Part> for Parts {
    fn from_iter<I: IntoIterator<Item = Part>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<Part>>().into()
    }
}

impl<'a> IntoIterator for &'a Parts {
    type Item = &'a Part;
    type IntoIter = std::slice::Iter<'a, Part>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn etags_read_back_as_they_were_and_an_md5_is_held_as_its_bytes() {
        let md5 = "\"d41d8cd98f00b204e9800998ecf8427e\"";
        let tag = ETag::new(md5);
        assert_eq!(tag.md5(), Some(*b"\xd4\x1d\x8c\xd9\x8f\x00\xb2\x04\xe9\x80\x09\x98\xec\xf8\x42\x7e"));
        assert_eq!((tag.to_string(), format!("{tag:?}")), (md5.to_owned(), format!("{md5:?}")));
        assert!(tag == *md5 && tag == md5 && !tag.is_empty());
        assert_eq!(tag, md5.to_owned());
        assert_eq!(md5.to_owned(), tag);
        assert_eq!(tag, ETag::from(md5.to_owned()));
        // Any other spelling is kept as text: it must read back as it was.
        for other in [
            "",
            "\"D41D8CD98F00B204E9800998ECF8427E\"",
            "d41d8cd98f00b204e9800998ecf8427e",
            "\"d41d8cd98f00b204e9800998ecf8427e-3\"",
            "W/\"d41d8cd98f00b204e9800998ecf8427e\"",
            "\"d41d8cd98f00b204e9800998ecf8427g\"",
            "\"",
        ] {
            let tag = ETag::new(other);
            assert_eq!((tag.md5(), tag.to_string(), tag.is_empty()), (None, other.to_owned(), other.is_empty()));
            assert!(tag == *other && tag != *md5 && ETag::new(md5) != *other, "{other:?}");
        }
        assert!(ETag::default().is_empty() && ETag::default() == *"");
    }

    #[test]
    fn parts_read_as_a_slice_and_extensions_are_shared() {
        let mut exts = Exts::default();
        let part = |exts: &mut Exts, ext: &str| Part { ext: exts.get(ext), shard: 0, offset: 1, len: 2, crc32c: 3 };
        let (a, b) = (part(&mut exts, "jpg"), part(&mut exts, "jpg"));
        assert!(Arc::ptr_eq(&a.ext.0, &b.ext.0) && a.ext == "jpg" && a.ext.as_str() == "jpg");
        assert_eq!((format!("{}", a.ext), format!("{:?}", a.ext)), ("jpg".to_owned(), "\"jpg\"".to_owned()));
        let one = Parts::from(vec![a.clone()]);
        assert_eq!((one.as_slice(), format!("{one:?}")), (std::slice::from_ref(&a), format!("{:?}", vec![&a])));
        assert_eq!(one, Parts::from(a.clone()));
        let two: Parts = [a.clone(), part(&mut exts, "cls")].into_iter().collect();
        assert_eq!(two.iter().map(|p| &*p.ext).collect::<Vec<_>>(), ["jpg", "cls"]);
        assert_ne!(one, two);
        assert!(Parts::default().is_empty() && Parts::from(Vec::new()) == Parts::default());
    }

    #[test]
    fn names_read_as_strings_and_paths() {
        let name = Name::from("class-0001/x.jpg".to_owned());
        assert_eq!(std::path::Path::new("/d").join(&name), std::path::Path::new("/d/class-0001/x.jpg"));
        assert_eq!(name, "class-0001/x.jpg");
        assert_eq!("class-0001/x.jpg", name);
        assert!(name.as_str().ends_with(".jpg"));
        let (above, below) = ("class-0002".to_owned(), Name::from("class-0000"));
        assert!(name < above && name > below);
        assert_eq!(
            (format!("{name}"), format!("{name:?}")),
            ("class-0001/x.jpg".into(), "\"class-0001/x.jpg\"".into())
        );
        assert_eq!(String::from(name.clone()), *name);
    }

    proptest! {
        #[test]
        fn any_etag_reads_back_as_it_was(text in "\"?[0-9a-fA-F]{0,33}\"?|[ -~]{0,40}") {
            let tag = ETag::new(&text);
            prop_assert_eq!(tag.to_string(), text.clone());
            prop_assert!(tag == *text);
            prop_assert_eq!(&tag, &ETag::from(text.clone()));
            prop_assert_eq!(tag.len(), text.len());
        }
    }
}
