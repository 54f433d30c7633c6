//! Sample sources: detecting a dataset directory's format, listing its shards, and indexing them.
//!
//! Indexing reads every byte once (to validate framing and record each part's CRC32C), reports
//! progress in bytes, and either fails on the first corrupt region with its shard and byte offset, or,
//! with `skip_corrupt`, indexes around it and lists what it skipped. [`load_or_build`] reuses a
//! persisted index whose shard list (paths, sizes, mtimes) and settings still match; the index then holds
//! the files as listed, so that each path is held once ([`Index::from_bytes_listed`]). A stale one still
//! spares reading the files unchanged since it was built (`reuse`).

use crate::index::{
    ChunkCrcs, Ext, Exts, Index, IndexSettings, Listed, Part, Parts, Refused, Sample, ShardInfo, Skipped, SourceFormat,
    NO_LABEL,
};
use crate::mmap::MappedFile;
use crate::{proto, tfrecord};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use thiserror::Error;

mod listing;
mod lmdb;
mod reuse;
mod webdataset;

pub use listing::modified_ns;
use listing::walk;
pub use webdataset::split_key;

/// Why a dataset could not be indexed.
#[derive(Debug, Error)]
pub enum IndexError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("corrupt data in {shard} at byte {offset}: {message} (pass --skip-corrupt to index around it)")]
    Corrupt { shard: PathBuf, offset: u64, message: String },
    #[error("cannot read the LMDB environment in {path}: {message}")]
    Lmdb { path: PathBuf, message: String },
    /// A `data.mdb` refused before LMDB read it (LMDB trusts its file: a damaged one crashed the process).
    #[error("cannot read the LMDB environment in {path}: {source}")]
    LmdbDamaged { path: PathBuf, source: lmdb::Damage },
    #[error(
        "{path} holds its samples in named LMDB databases ({names}): batchfs serves an environment's main \
         database; write the samples there (a writer's default database, not open_db(NAME))"
    )]
    NamedDatabases { path: PathBuf, names: String },
    #[error("{path} holds no samples in {format} format")]
    Empty { path: PathBuf, format: SourceFormat },
    #[error(
        "the name of {path:?} is not UTF-8: batchfs serves file names as text, so every name in a dataset \
         must be UTF-8 (rename it, e.g. with convmv, or hide it with a leading '.')"
    )]
    NotUtf8 { path: PathBuf },
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> IndexError + '_ {
    move |source| IndexError::Io { path: path.to_owned(), source }
}

/// What to index and how strictly.
#[derive(Debug, Clone, Copy)]
pub struct IndexOptions {
    /// Force a source format instead of detecting it.
    pub format: Option<SourceFormat>,
    /// Check every TFRecord's data CRC while indexing (the length CRC is always checked).
    pub verify_data_crc: bool,
    /// Index around corrupt regions instead of failing.
    pub skip_corrupt: bool,
    /// Follow symbolic links that lead out of the dataset's directory too (by default those are left out,
    /// with a warning: one planted there would serve any file the server can read).
    pub follow_links: bool,
}

impl Default for IndexOptions {
    fn default() -> Self {
        IndexOptions { format: None, verify_data_crc: true, skip_corrupt: false, follow_links: false }
    }
}

/// Receives indexing progress, in bytes of shard data.
pub trait Progress: Sync {
    /// Indexing starts: `total` bytes in `shards` shards.
    fn start(&self, total: u64, shards: usize);
    /// `bytes` more were indexed.
    fn advance(&self, bytes: u64);
}

/// A [`Progress`] that reports nothing.
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _: u64, _: usize) {}
    fn advance(&self, _: u64) {}
}

/// The file name an index is persisted under, beside the data.
pub const INDEX_FILE_NAME: &str = ".batchfs-index";

/// Where the index of dataset `name` at `root` lives: `index_dir/NAME.batchfs-index`, or beside the data.
pub fn index_path(root: &Path, name: &str, index_dir: Option<&Path>) -> PathBuf {
    match index_dir {
        Some(dir) => dir.join(format!("{name}.batchfs-index")),
        None => root.join(INDEX_FILE_NAME),
    }
}

/// `path` without its extension `ext` (`.tar`), where it ends with it, ASCII case aside: shards are
/// taken by extension in every case (`A.TAR`, `b.TFRecord`, as exporters and Windows tools write them), in
/// local trees and buckets alike. Fixed file names (LMDB's `data.mdb`, DALI's `.idx` twins, which readers
/// open under the exact name) are matched exactly.
fn strip_extension<'a>(path: &'a str, ext: &str) -> Option<&'a str> {
    let at = path.len().checked_sub(ext.len())?;
    // Equal to an ASCII extension, those bytes are ASCII: `at` is a character boundary.
    path.as_bytes()[at..].eq_ignore_ascii_case(ext.as_bytes()).then(|| &path[..at])
}

/// Whether `path` ends with extension `ext`, ASCII case aside ([`strip_extension`]).
fn has_extension(path: &str, ext: &str) -> bool {
    strip_extension(path, ext).is_some()
}

fn is_tfrecord(path: &str) -> bool {
    [".tfrecord", ".tfrecords", ".tfr"].iter().any(|ext| has_extension(path, ext))
}

fn is_tar(path: &str) -> bool {
    has_extension(path, ".tar")
}

/// Whether `path`'s file name ends as TensorFlow names its shards, without an extension:
/// `NAME-NNNNN-of-NNNNN` (`train-00000-of-01024` of ImageNet's build script, `train.tfrecord-00000-of-00001`).
fn is_tensorflow_shard_name(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Some((rest, total)) = name.rsplit_once("-of-") else { return false };
    rest.rsplit_once('-').is_some_and(|(stem, shard)| !stem.is_empty() && digits(shard) && digits(total))
}

/// The first of `paths` named as TensorFlow names its shards (no extension) where [`detect_listed`] would
/// find a file tree: a bucket's `train-00000-of-01024` objects are then indexed as a tree of whole
/// objects (their contents are not looked at, as a local file's first frames are), which a user is to be
/// told (a local copy of them is TFRecord).
pub fn unnamed_tfrecord_shard<'a>(paths: impl Iterator<Item = &'a str> + Clone) -> Option<&'a str> {
    let mut paths = paths;
    match detect_listed(paths.clone()) {
        SourceFormat::Files => paths.find(|p| is_tensorflow_shard_name(p)),
        _ => None,
    }
}

/// Whether the file at `path`, of `size` bytes, starts with TFRecord frames: the first frame's length
/// matches its CRC and the frame fits in the file, and so does the second's where the first does not end
/// the file. Two reads of 12 bytes; a text file passes by chance once in 2^64.
fn starts_with_tfrecord_frames(path: &Path, size: u64) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(file) = std::fs::File::open(path) else { return false };
    let frame_end = |offset: u64| {
        let mut header = [0u8; tfrecord::HEADER_LEN as usize];
        file.read_exact_at(&mut header, offset).ok()?;
        let len = u64::from_le_bytes(header[..8].try_into().ok()?);
        let end = offset + tfrecord::frame_len(len.min(tfrecord::MAX_RECORD_LEN));
        (len <= tfrecord::MAX_RECORD_LEN && header == tfrecord::frame_header(len) && end <= size).then_some(end)
    };
    match frame_end(0) {
        Some(end) if end == size => true,
        Some(end) => frame_end(end).is_some(),
        None => false,
    }
}

/// Detects the format of the dataset at `root`: LMDB if it holds `data.mdb`, else TFRecord or tar if it
/// holds such shards by their extension ([`detect_listed`]), else TFRecord if the first file named as
/// TensorFlow names shards (`train-00000-of-01024`) starts with TFRecord frames, else a plain file tree.
pub fn detect(root: &Path) -> Result<SourceFormat, IndexError> {
    Ok(detect_walked(root, &walk_dir(root, false)?))
}

/// [`detect`] of the files [`walk_dir`] listed at `root`.
fn detect_walked(root: &Path, files: &[ShardInfo]) -> SourceFormat {
    let by_name = detect_listed(files.iter().map(|f| f.path.as_str()));
    // The first such file that holds anything: an empty shard is a valid TFRecord file, and proves nothing.
    let sharded = files.iter().find(|f| is_tensorflow_shard_name(&f.path) && f.size > 0);
    match sharded {
        Some(f)
            if by_name == SourceFormat::Files && starts_with_tfrecord_frames(&root.join(f.path.as_str()), f.size) =>
        {
            SourceFormat::Tfrecord
        }
        _ => by_name,
    }
}

/// The format of a dataset whose files have these paths (relative to its root, `/`-separated), by their
/// names alone: the rules of [`detect`] but the last (an object store's dataset whose TFRecord shards
/// have no extension needs its format given).
pub fn detect_listed<'a>(paths: impl Iterator<Item = &'a str> + Clone) -> SourceFormat {
    if paths.clone().any(|p| p == "data.mdb") {
        SourceFormat::Lmdb
    } else if paths.clone().any(is_tfrecord) {
        SourceFormat::Tfrecord
    } else if paths.clone().any(is_tar) {
        SourceFormat::Tar
    } else {
        SourceFormat::Files
    }
}

/// LMDB's lock files: the state of the processes using the environment where they lie, meaningless
/// elsewhere and rewritten by every reader there, so neither served nor a reason to re-index. `lock.mdb`
/// beside `data.mdb` in an environment's directory; `data.mdb-lock` beside one written as a single file
/// (`lmdb.open("DIR/data.mdb", subdir=False)`, `MDB_NOSUBDIR`: the lock is the data file's name and `-lock`).
pub const LMDB_LOCKS: [&str; 2] = ["lock.mdb", "data.mdb-lock"];

/// The shards of a dataset of `format` at `root` and the other regular files beside them (side files),
/// each sorted by path, as [`classify`] splits them (`given`: the format was given, not detected).
/// Hidden files (the index among them) are neither.
pub fn discover(
    root: &Path,
    format: SourceFormat,
    given: bool,
) -> Result<(Vec<ShardInfo>, Vec<ShardInfo>), IndexError> {
    classify(root, format, given, walk_dir(root, false)?)
}

/// The format of the dataset at `root` (given in `options`, else detected), its shards and its side files,
/// from one walk of its directory ([`detect`], [`discover`]; symbolic links out of it followed where
/// [`IndexOptions::follow_links`] says): walked twice, a dataset changing meanwhile could be detected as
/// one thing and listed as another, and every warning of the walk was said twice.
pub fn list(root: &Path, options: &IndexOptions) -> Result<ListedDataset, IndexError> {
    let files = walk_dir(root, options.follow_links)?;
    let format = options.format.unwrap_or_else(|| detect_walked(root, &files));
    let (shards, side) = classify(root, format, options.format.is_some(), files)?;
    Ok((format, shards, side))
}

/// What [`list`] finds: the format, the shards and the side files.
pub type ListedDataset = (SourceFormat, Vec<ShardInfo>, Vec<ShardInfo>);

/// [`walk`] of a directory, an error where `root` is none.
fn walk_dir(root: &Path, out_too: bool) -> Result<Vec<ShardInfo>, IndexError> {
    if !root.is_dir() {
        return Err(IndexError::NotADirectory(root.to_owned()));
    }
    walk(root, out_too)
}

/// Splits a dataset's files (sorted by path, hidden ones left out) into the shards of `format` and the
/// side files, leaving out LMDB's lock files ([`LMDB_LOCKS`]); an LMDB dataset without `data.mdb` is an error. TFRecord
/// shards are the files named `*.tfrecord`, `*.tfrecords`, `*.tfr` or as TensorFlow names shards
/// (`train-00000-of-01024`, where no file has such an extension); where the format was `given` and no
/// file is named so, every file but `.idx`
/// twins (`X.idx` beside `X`), whatever its name (a README beside named shards stays a side file).
/// Compressed tars beside a tar dataset's shards are side files, with a warning.
pub fn classify(
    root: &Path,
    format: SourceFormat,
    given: bool,
    files: Vec<ShardInfo>,
) -> Result<(Vec<ShardInfo>, Vec<ShardInfo>), IndexError> {
    let listed = |path: &str| files.binary_search_by(|f| f.path.as_str().cmp(path)).is_ok();
    let is_twin = |p: &str| p.strip_suffix(".idx").is_some_and(listed);
    // TensorFlow's shard names only where no shard has a TFRecord extension: beside `*.tfrecord` shards,
    // `vocab-00000-of-00001` or a checkpoint's `model.ckpt-1000.data-00000-of-00001` are side files.
    let by_extension = files.iter().any(|f| is_tfrecord(&f.path));
    let named = |p: &str| is_tfrecord(p) || (!by_extension && is_tensorflow_shard_name(p));
    let none_named = format == SourceFormat::Tfrecord && !files.iter().any(|f| named(&f.path));
    let is_shard = |p: &str| match format {
        SourceFormat::Tfrecord if given && none_named => !is_twin(p),
        SourceFormat::Tfrecord => named(p),
        SourceFormat::Tar => is_tar(p),
        SourceFormat::Lmdb => p == "data.mdb",
        SourceFormat::Files => true,
    };
    let shard: Vec<bool> = files.iter().map(|f| is_shard(&f.path)).collect();
    let (mut shards, mut side) = (Vec::new(), Vec::new());
    for (file, is_shard) in files.into_iter().zip(shard) {
        if format == SourceFormat::Lmdb && LMDB_LOCKS.contains(&file.path.as_str()) {
            continue;
        }
        if is_shard { &mut shards } else { &mut side }.push(file);
    }
    if format == SourceFormat::Lmdb && shards.is_empty() {
        // An environment written with subdir=False is one file (`train.lmdb`, beside `train.lmdb-lock`): it
        // said "entity not found".
        let message = "no data.mdb: an LMDB environment is a directory holding data.mdb (one written with \
                       subdir=False is a single file: move it into a directory of its own as data.mdb)";
        return Err(IndexError::Lmdb { path: root.to_owned(), message: message.into() });
    }
    let compressed = match format {
        SourceFormat::Tar | SourceFormat::Tfrecord => compressed_shards(&side),
        // A tree of nothing but compressed shards (each then a sample of its own bytes): said, not taken
        // without a word.
        SourceFormat::Files if !given && compressed_shards(&shards).len() == shards.len() => compressed_shards(&shards),
        _ => Vec::new(),
    };
    if let Some(first) = compressed.first() {
        tracing::warn!(
            root = %root.display(),
            files = compressed.len(),
            first,
            "compressed shards are no shards: batchfs serves records and tar members in place, which \
             compression does not allow; decompress them to serve their samples (they are shown under raw/ \
             as they are{})",
            if format == SourceFormat::Files { ", and each is a sample of the file tree" } else { "" }
        );
    }
    if matches!(format, SourceFormat::Tar | SourceFormat::Tfrecord) && !given && side.len() > 4 * shards.len() {
        // One `backup/old.tar` in an ImageFolder tree made it a tar dataset of one shard.
        tracing::warn!(
            root = %root.display(), shards = shards.len(), side_files = side.len(), %format,
            "far more files beside the shards than shards: if this is a file tree, pass --format files"
        );
    }
    Ok((shards, side))
}

/// The compressed shards among `files`: tars (`.tar.gz`, `.tgz`, `.tar.bz2`, `.tar.xz`, `.tar.zst`,
/// `.tar.lz4`) and TFRecord files (`.tfrecord.gz`, `.tfrecords.zst`...).
fn compressed_shards(files: &[ShardInfo]) -> Vec<&str> {
    const PACKED: [&str; 5] = [".gz", ".bz2", ".xz", ".zst", ".lz4"];
    let compressed = |p: &str| {
        has_extension(p, ".tgz")
            || PACKED.iter().any(|ext| strip_extension(p, ext).is_some_and(|inner| is_tar(inner) || is_tfrecord(inner)))
    };
    files.iter().map(|f| f.path.as_str()).filter(|p| compressed(p)).collect()
}

/// What [`Files::read_each`] hands each file's bytes to, with the file's position in the list.
pub type EachFile<'a> = dyn FnMut(usize, &[u8]) -> Result<(), IndexError> + 'a;

/// Where indexing reads a dataset's files: a local directory ([`Directory`]), or an object store (the
/// server's object sources, which stage each object on local disk while it is indexed).
pub trait Files: Sync {
    /// Where the dataset is, for messages: its directory, or its URL.
    fn root(&self) -> &Path;
    /// A local file holding the bytes of `file`, under `file`'s own name (LMDB opens the directory of
    /// `data.mdb`), for as long as the returned [`Local`] lives.
    fn local(&self, file: &ShardInfo) -> io::Result<Local>;

    /// The index the source keeps beside the data itself (an object store's `.batchfs-index`, where
    /// asked to), if it keeps one and has it. By default none.
    fn kept_index(&self) -> Option<Vec<u8>> {
        None
    }

    /// Keeps `index` (its bytes) beside the data; `Ok(false)` where the source keeps none (the default).
    fn keep_index(&self, _index: &[u8]) -> io::Result<bool> {
        Ok(false)
    }

    /// Reads each of `files` whole and hands its bytes to `each` with its position in `files`, in any
    /// order, stopping at the first error. Many small files (a file tree) are read this way: an object
    /// store reads many at once. By default, one at a time through [`Files::local`].
    fn read_each(&self, files: &[ShardInfo], each: &mut EachFile) -> Result<(), IndexError> {
        for (i, file) in files.iter().enumerate() {
            let map = map_shard(self, file)?;
            each(i, map.bytes())?;
        }
        Ok(())
    }
}

/// A dataset file on local disk, while indexing reads it ([`Files::local`]).
pub struct Local {
    pub path: PathBuf,
    /// What removes a staged copy when dropped (nothing for a file of a local dataset).
    pub staged: Option<Box<dyn Send>>,
}

/// A dataset in a local directory.
pub struct Directory<'a>(pub &'a Path);

impl Files for Directory<'_> {
    fn root(&self) -> &Path {
        self.0
    }
    fn local(&self, file: &ShardInfo) -> io::Result<Local> {
        Ok(Local { path: self.0.join(&file.path), staged: None })
    }
}

/// How an index was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexOrigin {
    /// Loaded from a persisted index that was still fresh.
    Loaded,
    /// Built now (and persisted where possible).
    Built,
}

/// Loads the persisted index of dataset `name` at `root` if it is still fresh, else builds and persists
/// it. A persisted index that cannot be written (read-only dataset, no `index_dir`) is logged and kept
/// in memory only.
pub fn load_or_build(
    root: &Path,
    name: &str,
    index_dir: Option<&Path>,
    options: &IndexOptions,
    progress: &dyn Progress,
) -> Result<(Index, IndexOrigin), IndexError> {
    let (format, shards, side) = list(root, options)?;
    let path = index_path(root, name, index_dir);
    load_or_build_listed(&Directory(root), name, Some(&path), options.settings(format), shards, side, progress)
}

impl IndexOptions {
    /// The settings an index of `format` built with these options records.
    pub fn settings(&self, format: SourceFormat) -> IndexSettings {
        IndexSettings { format, verify_data_crc: self.verify_data_crc, skip_corrupt: self.skip_corrupt }
    }
}

/// [`load_or_build`] for a dataset already listed (its `shards` and `side` files, as [`classify`] splits
/// them) whose files `files` reads: the index persisted at `path`, else the one `files` keeps beside the
/// data ([`Files::kept_index`]), is reused if its settings and files are the same; else the index is
/// built and persisted at both (neither: kept in memory only), reading only the files changed since the
/// stale index was built, if there is one (`reuse`).
pub fn load_or_build_listed(
    files: &dyn Files,
    name: &str,
    path: Option<&Path>,
    settings: IndexSettings,
    shards: Vec<ShardInfo>,
    side: Vec<ShardInfo>,
    progress: &dyn Progress,
) -> Result<(Index, IndexOrigin), IndexError> {
    let (index, origin) = load_or_build_unkept(files, name, path, settings, shards, side, progress)?;
    if origin == IndexOrigin::Built {
        persist(files, name, path, &index);
    }
    Ok((index, origin))
}

/// [`load_or_build_listed`] without persisting an index it builds: for a caller that persists it
/// ([`persist`]) only once the dataset opened with it (an object dataset's objects held in memory read
/// again and checked against it), so that an index found wrong is never kept to be loaded by the next start.
pub fn load_or_build_unkept(
    files: &dyn Files,
    name: &str,
    path: Option<&Path>,
    settings: IndexSettings,
    shards: Vec<ShardInfo>,
    side: Vec<ShardInfo>,
    progress: &dyn Progress,
) -> Result<(Index, IndexOrigin), IndexError> {
    let mut listed = Listed { settings, shards, side };
    // A stale index: what it says of the files unchanged since is taken, not read again.
    let mut stale = None;
    // An index persisted before, if it is still the dataset's (it then holds the listed files).
    let mut fresh = |bytes: Vec<u8>, at: &str| match Index::from_bytes_listed(&bytes, &mut listed) {
        Ok(index) => {
            tracing::debug!(dataset = name, at, "reusing persisted index");
            Some(index)
        }
        Err(Refused::Stale) => {
            tracing::info!(dataset = name, at, "files or settings changed since the index was built; indexing again");
            // Parsed whole only where its settings are the ones indexing needs (else nothing is taken).
            if stale.is_none() && Index::settings_of(&bytes) == Some(settings) {
                stale = Index::from_bytes(&bytes);
            }
            None
        }
        Err(Refused::Unreadable) => {
            tracing::warn!(dataset = name, at, "persisted index is unreadable; rebuilding");
            None
        }
        Err(Refused::Version) => {
            tracing::info!(
                dataset = name,
                at,
                "persisted index is of another layout or of other rules for its format (made by another release); \
                 rebuilding"
            );
            None
        }
    };
    let at_path = path.and_then(|path| Some((std::fs::read(path).ok()?, path.display().to_string())));
    if let Some(index) = at_path.and_then(|(bytes, at)| fresh(bytes, &at)) {
        return Ok((index, IndexOrigin::Loaded));
    }
    if let Some(index) = files.kept_index().and_then(|bytes| fresh(bytes, "beside the data")) {
        return Ok((index, IndexOrigin::Loaded));
    }
    let Listed { shards, side, .. } = listed;
    let index = build_from(files, settings, shards, side, stale.as_ref(), progress)?;
    Ok((index, IndexOrigin::Built))
}

/// Persists `index`, just built, of dataset `name`: at `path`, and beside the data where `files` keeps it
/// there ([`Files::keep_index`]). One that cannot be written is logged: it is rebuilt at the next start.
pub fn persist(files: &dyn Files, name: &str, path: Option<&Path>, index: &Index) {
    let bytes = index.to_bytes();
    let kept_beside = match files.keep_index(&bytes) {
        Ok(kept) => kept,
        Err(e) => {
            tracing::warn!(dataset = name, error = %e, "cannot keep the index beside the data");
            false
        }
    };
    match path {
        Some(path) => {
            if let Err(e) = crate::atomic::write(path, &bytes, 0o644) {
                tracing::warn!(dataset = name, path = %path.display(), error = %e,
                    "cannot persist the index (it will be rebuilt at the next start); \
                     pass --index-dir to keep it elsewhere");
            }
        }
        None if kept_beside => {}
        None => tracing::warn!(
            dataset = name,
            "the index is not persisted (it will be rebuilt at the next start); \
            pass --index-dir to keep it"
        ),
    }
}

/// Builds the index of the dataset at `root` (not persisted).
pub fn build(root: &Path, options: &IndexOptions, progress: &dyn Progress) -> Result<Index, IndexError> {
    let (format, shards, side) = list(root, options)?;
    build_from(&Directory(root), options.settings(format), shards, side, None, progress)
}

/// Builds the index of a dataset listed as `shards` and `side` files, reading them through `files`; what
/// `previous` (an earlier index of the dataset) holds of files unchanged since is taken from it instead.
pub fn build_from(
    files: &dyn Files,
    settings: IndexSettings,
    shards: Vec<ShardInfo>,
    side: Vec<ShardInfo>,
    previous: Option<&Index>,
    progress: &dyn Progress,
) -> Result<Index, IndexError> {
    let reuse = previous.and_then(|p| reuse::Previous::new(p, settings));
    if let Some(r) = &reuse {
        // Said: the progress that follows counts the whole dataset, the files taken as well.
        let lmdb = settings.format == SourceFormat::Lmdb;
        let taken = shards.iter().filter(|f| !lmdb && r.known(f, false).is_some()).count()
            + side.iter().filter(|f| r.known(f, true).is_some()).count();
        let total = shards.len() + side.len();
        tracing::info!(
            dataset = %files.root().display(), files = total, unchanged = taken, read = total - taken,
            "indexing again: the files unchanged since the stale index are taken from it, the rest read"
        );
    }
    progress.start(shards.iter().chain(&side).map(|s| s.size).sum(), shards.len() + side.len());
    let mut index =
        Index { settings, shards, side: Vec::new(), samples: Vec::new(), classes: Vec::new(), skipped: Vec::new() };
    // Side files are served as they are: only their checksums are needed.
    let crcs = checksums_of(files, &side, reuse.as_ref().map(|r| (r, true)), progress)?;
    index.side =
        side.into_iter().zip(crcs).map(|(file, (crc32c, chunks))| ShardInfo { crc32c, chunks, ..file }).collect();
    match settings.format {
        SourceFormat::Tfrecord => index_tfrecord(files, &mut index, reuse.as_ref(), progress)?,
        SourceFormat::Lmdb => lmdb::index(files, &mut index, progress)?,
        SourceFormat::Tar => webdataset::index(files, &mut index, reuse.as_ref(), progress)?,
        SourceFormat::Files => index_files(files, &mut index, reuse.as_ref(), progress)?,
    }
    if index.samples.is_empty() && index.skipped.is_empty() {
        return Err(IndexError::Empty { path: files.root().to_owned(), format: settings.format });
    }
    Ok(index)
}

/// Records a corrupt region: an error, or with `skip_corrupt` an entry in `index.skipped`.
/// `what` is wrong there; `skipping` says what `skip_corrupt` leaves out for it (empty: that region only),
/// said only where it is done (a refusal said "the rest of the shard is skipped" as the server stopped).
fn corrupt(index: &mut Index, root: &Path, at: (&str, u64), what: String, skipping: &str) -> Result<(), IndexError> {
    let (shard, offset) = at;
    if index.settings.skip_corrupt {
        let message = match skipping {
            "" => what,
            _ => format!("{what}; {skipping}"),
        };
        tracing::warn!(shard, offset, %message, "skipping corrupt region");
        index.skipped.push(Skipped { shard: shard.to_owned(), offset, reason: message });
        Ok(())
    } else {
        Err(IndexError::Corrupt { shard: root.join(shard), offset, message: what })
    }
}

/// The checksums of each of `list`: those `reuse` knows (of side files, or of shards), the rest read.
fn checksums_of(
    files: &dyn Files,
    list: &[ShardInfo],
    reuse: Option<(&reuse::Previous, bool)>,
    progress: &dyn Progress,
) -> Result<Vec<(u32, ChunkCrcs)>, IndexError> {
    let known: Vec<_> = list.iter().map(|f| reuse.and_then(|(r, side)| r.checksums(f, side))).collect();
    let unknown: Vec<usize> = (0..list.len()).filter(|&i| known[i].is_none()).collect();
    let read: Vec<ShardInfo> = unknown.iter().map(|&i| list[i].clone()).collect();
    let mut crcs: Vec<_> = known.into_iter().map(Option::unwrap_or_default).collect();
    progress.advance(list.iter().map(|f| f.size).sum::<u64>() - read.iter().map(|f| f.size).sum::<u64>());
    for (i, sums) in unknown.into_iter().zip(checksums(files, &read, progress)?) {
        crcs[i] = sums;
    }
    Ok(crcs)
}

/// The CRC32C of each of `list` and of its chunks ([`crate::index::chunk_crcs`]), read through
/// [`Files::read_each`]; a file whose size is not the listed one is an error (it is being written to).
fn checksums(
    files: &dyn Files,
    list: &[ShardInfo],
    progress: &dyn Progress,
) -> Result<Vec<(u32, ChunkCrcs)>, IndexError> {
    let mut crcs = vec![(0u32, ChunkCrcs::default()); list.len()];
    files.read_each(list, &mut |i, bytes| {
        if bytes.len() as u64 != list[i].size {
            return Err(IndexError::Io {
                path: files.root().join(&list[i].path),
                source: io::Error::other("file changed size while indexing; datasets must not change while served"),
            });
        }
        crcs[i] = crate::index::chunk_crcs(bytes);
        progress.advance(list[i].size);
        Ok(())
    })?;
    Ok(crcs)
}

/// The bytes of `shard`, mapped (a staged copy is removed once mapped: the mapping keeps its pages).
fn map_shard<F: Files + ?Sized>(files: &F, shard: &ShardInfo) -> Result<MappedFile, IndexError> {
    let path = files.root().join(&shard.path);
    let local = files.local(shard).map_err(io_err(&path))?;
    MappedFile::open(&local.path).map_err(io_err(&path))
}

/// Names under which a `tf.train.Example` commonly carries its key and its label.
const EXAMPLE_KEY_FEATURES: [&str; 3] = ["key", "image/filename", "__key__"];
const EXAMPLE_LABEL_FEATURES: [&str; 2] = ["label", "image/class/label"];

fn example_key_label(record: &[u8]) -> (Option<String>, i64) {
    let key = EXAMPLE_KEY_FEATURES.iter().find_map(|name| match proto::example_feature(record, name) {
        Ok(Some(proto::FeatureValue::Bytes(v))) => v.first().map(|b| String::from_utf8_lossy(b).into_owned()),
        _ => None,
    });
    let label = EXAMPLE_LABEL_FEATURES
        .iter()
        .find_map(|name| match proto::example_feature(record, name) {
            Ok(Some(proto::FeatureValue::Int64(v))) => v.first().copied(),
            _ => None,
        })
        .unwrap_or(NO_LABEL);
    (key, label)
}

fn index_tfrecord(
    files: &dyn Files,
    index: &mut Index,
    reuse: Option<&reuse::Previous>,
    progress: &dyn Progress,
) -> Result<(), IndexError> {
    let ext = Ext::from("example");
    each_shard_read(files, index, reuse, progress, |index, shard_no, shard, bytes| {
        let stem = shard.path.rsplit_once('.').map_or(shard.path.as_str(), |(s, _)| s);
        let mut scanner = tfrecord::Scanner::new(bytes, index.settings.verify_data_crc);
        let mut reported = 0;
        let mut record_no = 0u64;
        while let Some(item) = scanner.next() {
            match item {
                Ok(pos) => {
                    let data = &bytes[pos.data_offset() as usize..(pos.data_offset() + pos.len) as usize];
                    let (key, label) = example_key_label(data);
                    index.samples.push(Sample {
                        key: key.unwrap_or_else(|| format!("{stem}/{record_no:08}")).into(),
                        label,
                        parts: Parts::from(Part {
                            ext: ext.clone(),
                            shard: shard_no as u32,
                            offset: pos.data_offset(),
                            len: pos.len,
                            crc32c: pos.data_crc,
                        }),
                    });
                }
                Err(e) => {
                    let offset = match &e {
                        tfrecord::TfRecordError::Truncated { offset, .. }
                        | tfrecord::TfRecordError::BadLengthCrc { offset }
                        | tfrecord::TfRecordError::BadDataCrc { offset, .. }
                        | tfrecord::TfRecordError::TooLong { offset, .. } => *offset,
                    };
                    let rest = if e.is_recoverable() { "" } else { "the rest of the shard is skipped" };
                    corrupt(index, files.root(), (&shard.path, offset), e.to_string(), rest)?;
                }
            }
            record_no += 1;
            progress.advance(scanner.position() - reported);
            reported = scanner.position();
        }
        progress.advance(shard.size - reported);
        Ok(())
    })
}

/// Each shard of `index` in turn, for the formats whose samples each lie in one shard (TFRecord, WebDataset
/// tar): what `reuse` knows of it taken, else its bytes (mapped, read ahead) handed to `each` with its
/// number, and its checksums computed after.
fn each_shard_read(
    files: &dyn Files,
    index: &mut Index,
    reuse: Option<&reuse::Previous>,
    progress: &dyn Progress,
    mut each: impl FnMut(&mut Index, usize, &ShardInfo, &[u8]) -> Result<(), IndexError>,
) -> Result<(), IndexError> {
    let shards = index.shards.clone();
    for (shard_no, shard) in shards.iter().enumerate() {
        if reuse.is_some_and(|r| r.take(index, shard_no)) {
            progress.advance(shard.size);
            continue;
        }
        let map = map_shard(files, shard)?;
        map.advise(memmap2::Advice::Sequential);
        each(index, shard_no, shard, map.bytes())?;
        index.shards[shard_no].checksum(map.bytes());
    }
    Ok(())
}

fn index_files(
    files: &dyn Files,
    index: &mut Index,
    reuse: Option<&reuse::Previous>,
    progress: &dyn Progress,
) -> Result<(), IndexError> {
    // Classes: the first directory of every file, sorted (ImageFolder's rule); files at the top level
    // carry no label.
    let mut classes = BTreeMap::new();
    for shard in &index.shards {
        if let Some((class, _)) = shard.path.split_once('/') {
            classes.insert(class.to_owned(), 0i64);
        }
    }
    for (i, v) in classes.values_mut().enumerate() {
        *v = i as i64;
    }
    index.classes = classes.keys().cloned().collect();
    let shards = index.shards.clone();
    let crcs = checksums_of(files, &shards, reuse.map(|r| (r, false)), progress)?;
    let mut exts = Exts::default();
    for (shard_no, (shard, (crc, chunks))) in shards.iter().zip(crcs).enumerate() {
        let base_start = shard.path.rfind('/').map_or(0, |i| i + 1);
        let (key, ext) = match shard.path[base_start..].rfind('.') {
            Some(dot) if dot > 0 => (&shard.path[..base_start + dot], &shard.path[base_start + dot + 1..]),
            _ => (shard.path.as_str(), ""),
        };
        let label = shard.path.split_once('/').map_or(NO_LABEL, |(class, _)| classes[class]);
        (index.shards[shard_no].crc32c, index.shards[shard_no].chunks) = (crc, chunks);
        let part = Part { ext: exts.get(ext), shard: shard_no as u32, offset: 0, len: shard.size, crc32c: crc };
        index.samples.push(Sample { key: key.into(), label, parts: part.into() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::webdataset::text_label;
    use super::*;
    use crate::gen::{self, GenOptions};
    use crate::index::CHUNK_BYTES;
    use crate::mmap::LmdbEnv;
    use crate::{crc, tar};

    #[test]
    fn webdataset_keys() {
        assert_eq!(split_key("a/b/000123.jpg"), Some(("a/b/000123", "jpg")));
        assert_eq!(split_key("x.seg.png"), Some(("x", "seg.png")));
        assert_eq!(split_key("abc."), Some(("abc", "")));
        // As WebDataset's `^((?:.*/|)[^.]+)[.]([^/]*)$` reads them (checked against webdataset 1.0.2): no key
        // for a name without a `.` in its file name, or starting with one at the top; a hidden file in a
        // folder is that folder's; a `__meta__` name is in no sample.
        assert_eq!(split_key("dir.v2/abc"), None);
        assert_eq!(split_key("./._000000.jpg"), None);
        assert_eq!(split_key("README"), None);
        assert_eq!(split_key("dir/._s4.JPG"), Some(("dir/", "_s4.JPG")));
        assert_eq!(split_key("a.b/._x.jpg"), None);
        assert_eq!(split_key("__meta__"), None);
        assert_eq!(split_key("__meta__/x.json"), None);
        assert_eq!(split_key("__key__.json"), Some(("__key__", "json")));
    }

    #[test]
    fn text_labels() {
        assert_eq!(text_label(b" 42\n"), Some(42));
        assert_eq!(text_label(b"cat"), None);
    }

    fn generated(format: SourceFormat, samples: u32) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let options =
            GenOptions { format, samples, mean_bytes: 2000, shards: 2, classes: 3, seed: 1, ..GenOptions::default() };
        gen::generate(&options, dir.path()).unwrap();
        dir
    }

    fn strict() -> IndexOptions {
        IndexOptions::default()
    }

    fn skipping() -> IndexOptions {
        IndexOptions { skip_corrupt: true, ..IndexOptions::default() }
    }

    #[test]
    fn corrupt_tfrecord_names_shard_and_offset() {
        let dir = generated(SourceFormat::Tfrecord, 10);
        let shard = dir.path().join("train-00000-of-00002.tfrecord");
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        let victim = &index.samples[2].parts[0];
        let mut bytes = std::fs::read(&shard).unwrap();
        bytes[(victim.offset + 5) as usize] ^= 0x55;
        std::fs::write(&shard, &bytes).unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        let frame = victim.offset - tfrecord::HEADER_LEN;
        assert!(err.contains("train-00000-of-00002.tfrecord") && err.contains(&format!("byte {frame}")), "{err}");
        assert!(err.contains("bad data CRC") && err.contains("--skip-corrupt"), "{err}");
        // Skipping: the one bad record is left out and reported; the rest of the shard is indexed.
        let index = build(dir.path(), &skipping(), &NoProgress).unwrap();
        assert_eq!(index.samples.len(), 9);
        assert_eq!(index.skipped.len(), 1);
        assert_eq!(index.skipped[0].offset, frame);
        // Without data CRC checks the record is indexed (clients still verify batches end to end).
        let fast = IndexOptions { verify_data_crc: false, ..strict() };
        assert_eq!(build(dir.path(), &fast, &NoProgress).unwrap().samples.len(), 10);
    }

    #[test]
    fn truncated_tfrecord_and_tar_are_reported() {
        let dir = generated(SourceFormat::Tfrecord, 10);
        let shard = dir.path().join("train-00001-of-00002.tfrecord");
        let len = std::fs::metadata(&shard).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 3).unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("truncated record") && err.contains("train-00001-of-00002.tfrecord"), "{err}");
        let index = build(dir.path(), &skipping(), &NoProgress).unwrap();
        assert_eq!(index.samples.len(), 9);

        let dir = generated(SourceFormat::Tar, 6);
        let shard = dir.path().join("shard-000000.tar");
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        let last = index.samples.iter().rev().find(|s| s.parts[0].shard == 0).unwrap();
        let cut = last.parts[0].offset + 10; // inside the last sample's jpg member
        std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(cut).unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("cut short") && err.contains(&format!("byte {}", last.parts[0].offset - 512)), "{err}");
        let skipped = build(dir.path(), &skipping(), &NoProgress).unwrap();
        assert_eq!(skipped.samples.len(), 5, "the cut sample is dropped whole");
        assert!(skipped.samples.iter().all(|s| s.parts.len() == 2));
    }

    /// A tar that ends inside a pax header (of a long name), or inside a member WebDataset leaves out (a name
    /// of no key), after a sample's first member: what follows may have been that sample's, so with
    /// `--skip-corrupt` it is dropped whole (it was kept with a part missing); the sample before is kept.
    #[test]
    fn a_tar_cut_inside_an_extended_header_or_a_keyless_member_drops_the_sample_being_grouped() {
        let member = |name: &str, data: &[u8]| {
            let mut out = tar::file_header(name, data.len() as u64);
            out.extend_from_slice(data);
            out.resize(out.len() + tar::padding(data.len() as u64) as usize, 0);
            out
        };
        let long = format!("{}/a.cls", "d".repeat(150));
        let head = [member("z0.jpg", b"zz"), member("z0.cls", b"1"), member("a.jpg", b"JPEG")].concat();
        let pax = tar::file_header(&long, 1);
        let readme = member("README", &[b'r'; 700]);
        for (tail, what) in [(&pax[..512 + 50], "inside a header"), (&readme[..512 + 100], "\"README\"")] {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("s.tar"), [&head[..], tail].concat()).unwrap();
            let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
            let index = build(dir.path(), &skipping(), &NoProgress).unwrap();
            let keys: Vec<&str> = index.samples.iter().map(|s| s.key.as_ref()).collect();
            assert_eq!(keys, ["z0"], "sample \"a\" may be missing a part: dropped whole");
        }
    }

    #[test]
    fn unreadable_lmdb_is_a_clear_error_and_no_lock_file_is_written() {
        let dir = generated(SourceFormat::Lmdb, 8);
        std::fs::remove_file(dir.path().join("lock.mdb")).unwrap();
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        assert_eq!(index.samples.len(), 8);
        assert!(index.samples.iter().all(|s| s.parts[0].ext == "datum" && s.label >= 0));
        assert!(!dir.path().join("lock.mdb").exists(), "indexing must not create lock.mdb");
        std::fs::write(dir.path().join("data.mdb"), vec![7u8; 10_000]).unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("LMDB") && err.contains(&dir.path().display().to_string()), "{err}");
    }

    /// A `data.mdb` cut short (a copy in part) is said to be truncated, before LMDB maps it: it was "the
    /// value of key \"\" is not stored contiguously", or a SIGBUS where LMDB read a page past its end.
    #[test]
    fn a_truncated_lmdb_is_said_to_be_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let env = LmdbEnv::create(dir.path(), 64 << 20, 0).unwrap();
        let mut wtxn = env.env().write_txn().unwrap();
        let db = env.env().create_database::<heed::types::Bytes, heed::types::Bytes>(&mut wtxn, None).unwrap();
        for i in 0..2000u32 {
            db.put(&mut wtxn, format!("{i:08}").as_bytes(), &vec![i as u8; 3000]).unwrap();
        }
        wtxn.commit().unwrap();
        env.close();
        let data = dir.path().join("data.mdb");
        let whole = std::fs::read(&data).unwrap();
        assert_eq!(lmdb::needed_bytes(&whole).map(|n| n <= whole.len() as u64), Some(true));
        build(dir.path(), &strict(), &NoProgress).expect("the whole file indexes");
        std::fs::remove_file(dir.path().join(INDEX_FILE_NAME)).ok();
        std::fs::write(&data, &whole[..whole.len() / 2]).unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("the file is truncated"), "{err}");
    }

    /// An environment whose samples are in named databases (`max_dbs`, `open_db(b"train")`) holds in its
    /// main database one record per named database: those are not samples, and the environment is
    /// refused with their names rather than served as 48-byte records; beside samples of the main
    /// database, they are left out.
    #[test]
    fn lmdb_with_named_databases_is_refused_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let env = LmdbEnv::create(dir.path(), 1 << 20, 2).unwrap();
        let mut wtxn = env.env().write_txn().unwrap();
        for name in ["train", "meta"] {
            let db = env.env().create_database::<heed::types::Bytes, heed::types::Bytes>(&mut wtxn, Some(name));
            db.unwrap().put(&mut wtxn, b"000001", b"a sample's bytes").unwrap();
        }
        wtxn.commit().unwrap();
        env.close();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        let data = dir.path().join("data.mdb");
        let named = format!("{} holds its samples in named LMDB databases (\"meta\", \"train\")", data.display());
        assert!(err.starts_with(&named), "{err}");
        assert!(err.contains("main database"), "{err}");
        // Samples in the main database beside a named one (its writer's metadata): served, the named one
        // left out.
        let env = LmdbEnv::create(dir.path(), 1 << 20, 2).unwrap();
        let mut wtxn = env.env().write_txn().unwrap();
        let main = env.env().create_database::<heed::types::Bytes, heed::types::Bytes>(&mut wtxn, None).unwrap();
        for i in 0..5u32 {
            main.put(&mut wtxn, format!("{i:08}").as_bytes(), &[i as u8; 100]).unwrap();
        }
        wtxn.commit().unwrap();
        env.close();
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        let keys: Vec<&str> = index.samples.iter().map(|s| s.key.as_ref()).collect();
        assert_eq!(keys, ["00000000", "00000001", "00000002", "00000003", "00000004"]);
        assert!(index.samples.iter().all(|s| s.parts[0].len == 100));
    }

    /// A main database of several values a key (`MDB_DUPSORT`): a key's many values were left out as if a
    /// named database, a key's few read as one value (their sub-page's bytes). Refused, saying so; an empty
    /// `data.mdb` too (LMDB said "Bad file descriptor").
    #[test]
    fn lmdb_of_duplicate_keys_or_empty_is_refused_saying_so() {
        let dir = tempfile::tempdir().unwrap();
        let env = LmdbEnv::create(dir.path(), 1 << 20, 0).unwrap();
        let mut wtxn = env.env().write_txn().unwrap();
        let main = env
            .env()
            .database_options()
            .types::<heed::types::Bytes, heed::types::Bytes>()
            .flags(heed::DatabaseFlags::DUP_SORT)
            .create(&mut wtxn)
            .unwrap();
        for (key, value) in [(&b"a"[..], &b"one"[..]), (b"a", b"two"), (b"b", b"three")] {
            main.put(&mut wtxn, key, value).unwrap();
        }
        wtxn.commit().unwrap();
        env.close();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("several values under one key (MDB_DUPSORT)"), "{err}");
        std::fs::write(dir.path().join("data.mdb"), b"").unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("data.mdb is empty"), "{err}");
        // An environment written with subdir=False (one file), given as LMDB: said how to serve it.
        std::fs::rename(dir.path().join("data.mdb"), dir.path().join("train.lmdb")).unwrap();
        let given = IndexOptions { format: Some(SourceFormat::Lmdb), ..strict() };
        let err = build(dir.path(), &given, &NoProgress).unwrap_err().to_string();
        assert!(err.contains("no data.mdb") && err.contains("subdir=False"), "{err}");
    }

    /// A dataset made of links to shards elsewhere (they were left out without a word): each link is its
    /// file under the link's name, a linked class folder is listed, a link back up the tree lists nothing
    /// twice and a link to nothing is left out.
    #[test]
    fn symbolic_links_to_shards_and_folders_are_followed() {
        use std::os::unix::fs::symlink;
        let elsewhere = generated(SourceFormat::Tfrecord, 40);
        let (shards, _) = discover(elsewhere.path(), SourceFormat::Tfrecord, false).unwrap();
        let (all, _) = load_or_build(elsewhere.path(), "e", None, &strict(), &NoProgress).unwrap();
        let dir = tempfile::tempdir().unwrap();
        symlink(elsewhere.path().join(shards[0].path.as_str()), dir.path().join("a.tfrecord")).unwrap();
        std::fs::copy(elsewhere.path().join(shards[1].path.as_str()), dir.path().join("b.tfrecord")).unwrap();
        symlink("/nonexistent/c.tfrecord", dir.path().join("c.tfrecord")).unwrap();
        symlink(dir.path(), dir.path().join("loop")).unwrap();
        // Links in a loop (each other's target, or their own) stopped indexing: left out as a link to nothing.
        symlink("d2.tfrecord", dir.path().join("d1.tfrecord")).unwrap();
        symlink("d1.tfrecord", dir.path().join("d2.tfrecord")).unwrap();
        symlink("self", dir.path().join("self")).unwrap();
        // An index dir inside the dataset: its index is no file of it (it was read as one, changing).
        std::fs::create_dir(dir.path().join("idx")).unwrap();
        std::fs::write(dir.path().join("idx/t.batchfs-index"), b"an index").unwrap();
        // A link out of the dataset's directory is followed only where asked (one planted in a dataset
        // would serve any file the server can read); one inside it is followed.
        symlink("/etc/passwd", dir.path().join("README")).unwrap();
        symlink("b.tfrecord", dir.path().join("e.tfrecord")).unwrap();
        let inside = build(dir.path(), &strict(), &NoProgress).unwrap();
        let paths: Vec<&str> = inside.shards.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["b.tfrecord", "e.tfrecord"]);
        assert!(inside.side.is_empty(), "{:?}", inside.side);
        std::fs::remove_file(dir.path().join("README")).unwrap();
        std::fs::remove_file(dir.path().join("e.tfrecord")).unwrap();
        let following = IndexOptions { follow_links: true, ..strict() };
        let index = build(dir.path(), &following, &NoProgress).unwrap();
        let paths: Vec<&str> = index.shards.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["a.tfrecord", "b.tfrecord"]);
        assert!(index.side.is_empty(), "{:?}", index.side);
        assert_eq!(index.samples.len(), all.samples.len());
        assert_eq!(index.shards[0].size, shards[0].size, "the linked file's size, not the link's");

        let tree = generated(SourceFormat::Files, 12);
        let classes: Vec<String> = std::fs::read_dir(tree.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with('.'))
            .collect();
        let linked = tempfile::tempdir().unwrap();
        for class in &classes {
            symlink(tree.path().join(class), linked.path().join(class)).unwrap();
        }
        let of_links = build(linked.path(), &following, &NoProgress).unwrap();
        let of_tree = build(tree.path(), &strict(), &NoProgress).unwrap();
        assert_eq!((of_links.samples.len(), &of_links.classes), (12, &of_tree.classes));
        assert_eq!(of_links.samples, of_tree.samples);
        // A link to a class folder, named before it (`a-latest -> class-0`): the folder keeps its name and
        // its class; the link lists nothing twice (it took the folder's files and their class).
        symlink(tree.path().join(&classes[0]), tree.path().join("a-latest")).unwrap();
        let with_alias = build(tree.path(), &strict(), &NoProgress).unwrap();
        assert_eq!(with_alias.samples, of_tree.samples);
        assert_eq!(with_alias.classes, of_tree.classes);
    }

    #[test]
    fn index_is_persisted_reused_and_rebuilt_when_shards_change() {
        let dir = generated(SourceFormat::Tfrecord, 10);
        let (first, origin) = load_or_build(dir.path(), "d", None, &strict(), &NoProgress).unwrap();
        assert_eq!(origin, IndexOrigin::Built);
        assert!(dir.path().join(INDEX_FILE_NAME).exists());
        let (again, origin) = load_or_build(dir.path(), "d", None, &strict(), &NoProgress).unwrap();
        assert_eq!((origin, &again), (IndexOrigin::Loaded, &first));
        // Other settings: rebuilt.
        let (_, origin) = load_or_build(dir.path(), "d", None, &skipping(), &NoProgress).unwrap();
        assert_eq!(origin, IndexOrigin::Built);
        // A shard grows by one record: rebuilt, with the new sample.
        let shard = dir.path().join("train-00001-of-00002.tfrecord");
        let mut bytes = std::fs::read(&shard).unwrap();
        tfrecord::encode_record(b"one more", &mut bytes);
        std::fs::write(&shard, bytes).unwrap();
        let (grown, origin) = load_or_build(dir.path(), "d", None, &strict(), &NoProgress).unwrap();
        assert_eq!((origin, grown.samples.len()), (IndexOrigin::Built, 11));
        // A corrupt persisted index is ignored and replaced.
        std::fs::write(dir.path().join(INDEX_FILE_NAME), b"BATCHFSI garbage").unwrap();
        let (_, origin) = load_or_build(dir.path(), "d", None, &strict(), &NoProgress).unwrap();
        assert_eq!(origin, IndexOrigin::Built);
        // --index-dir keeps it elsewhere.
        let elsewhere = tempfile::tempdir().unwrap();
        load_or_build(dir.path(), "d", Some(elsewhere.path()), &strict(), &NoProgress).unwrap();
        assert!(elsewhere.path().join("d.batchfs-index").exists());
    }

    #[test]
    fn files_beside_the_shards_are_side_files_and_a_change_to_one_rebuilds() {
        let dir = generated(SourceFormat::Tfrecord, 10);
        std::fs::write(dir.path().join("train-00000-of-00002.tfrecord.idx"), b"0 10\n").unwrap();
        std::fs::create_dir(dir.path().join("docs")).unwrap();
        std::fs::write(dir.path().join("docs/README"), b"about").unwrap();
        let (index, _) = load_or_build(dir.path(), "d", None, &strict(), &NoProgress).unwrap();
        let side: Vec<(&str, u64, u32)> = index.side.iter().map(|f| (f.path.as_str(), f.size, f.crc32c)).collect();
        assert_eq!(
            side,
            [
                ("docs/README", 5, crc::crc32c(b"about")),
                ("train-00000-of-00002.tfrecord.idx", 5, crc::crc32c(b"0 10\n"))
            ]
        );
        assert_eq!(index.shards.len(), 2, "side files hold no samples");
        std::fs::write(dir.path().join("docs/README"), b"about it").unwrap();
        let (again, origin) = load_or_build(dir.path(), "d", None, &strict(), &NoProgress).unwrap();
        assert_eq!((origin, again.side[0].size), (IndexOrigin::Built, 8));
        // LMDB's lock file is the local readers' state: never a side file.
        let lmdb = generated(SourceFormat::Lmdb, 5);
        std::fs::write(lmdb.path().join("lock.mdb"), b"lock").unwrap();
        std::fs::write(lmdb.path().join("notes.txt"), b"n").unwrap();
        let (shards, side) = discover(lmdb.path(), SourceFormat::Lmdb, false).unwrap();
        assert_eq!(shards.iter().map(|s| s.path.as_str()).collect::<Vec<_>>(), ["data.mdb"]);
        assert_eq!(side.iter().map(|s| s.path.as_str()).collect::<Vec<_>>(), ["notes.txt"]);
    }

    /// An environment written as one file at `DIR/data.mdb` (`subdir=False`) has its lock beside it as
    /// `data.mdb-lock`: hidden as `lock.mdb` is (it was a side file, listed and served under `raw/`), and
    /// its change (every reader there rewrites it) rebuilds nothing; a file named otherwise stays a side file.
    #[test]
    fn the_lock_file_of_an_environment_written_as_one_file_is_hidden() {
        let dir = generated(SourceFormat::Lmdb, 5);
        std::fs::remove_file(dir.path().join("lock.mdb")).unwrap();
        std::fs::write(dir.path().join("data.mdb-lock"), b"readers").unwrap();
        std::fs::write(dir.path().join("other.mdb-lock"), b"n").unwrap();
        let (index, _) = load_or_build(dir.path(), "d", None, &strict(), &NoProgress).unwrap();
        assert_eq!(index.shards.iter().map(|s| s.path.as_str()).collect::<Vec<_>>(), ["data.mdb"]);
        assert_eq!(index.side.iter().map(|s| s.path.as_str()).collect::<Vec<_>>(), ["other.mdb-lock"]);
        std::fs::write(dir.path().join("data.mdb-lock"), b"readers, one more").unwrap();
        let (_, origin) = load_or_build(dir.path(), "d", None, &strict(), &NoProgress).unwrap();
        assert_eq!(origin, IndexOrigin::Loaded);
    }

    #[test]
    fn tfrecord_shards_get_the_index_twin_tfrecord2idx_writes_unless_they_have_one() {
        let dir = generated(SourceFormat::Tfrecord, 9);
        let theirs = "train-00001-of-00002.tfrecord.idx";
        std::fs::write(dir.path().join(theirs), b"their own\n").unwrap();
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        let twins = crate::encode::shard_index_twins(&index);
        assert_eq!(twins.len(), 1, "the shard with its own index keeps it");
        let (path, twin) = &twins[0];
        assert_eq!(path, "train-00000-of-00002.tfrecord.idx");
        // tfrecord2idx: each record's offset and its whole frame's size, read off the shard's headers.
        let shard = std::fs::read(dir.path().join("train-00000-of-00002.tfrecord")).unwrap();
        let mut want = String::new();
        let mut at = 0usize;
        while at < shard.len() {
            let len = u64::from_le_bytes(shard[at..at + 8].try_into().unwrap()) as usize;
            want.push_str(&format!("{at} {}\n", len + 16));
            at += len + 16;
        }
        assert_eq!(String::from_utf8(twin.clone()).unwrap(), want);
        assert!(crate::encode::shard_index_twins(
            &build(generated(SourceFormat::Tar, 4).path(), &strict(), &NoProgress).unwrap()
        )
        .is_empty());
    }

    #[test]
    fn files_larger_than_a_chunk_carry_each_chunks_crc() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..CHUNK_BYTES * 2 + 77).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(dir.path().join("big.bin"), &bytes).unwrap();
        std::fs::write(dir.path().join("small.bin"), b"tiny").unwrap();
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        let big = &index.shards[0];
        assert_eq!(big.crc32c, crc::crc32c(&bytes));
        let want: Vec<u32> = bytes.chunks(CHUNK_BYTES as usize).map(crc::crc32c).collect();
        assert_eq!((big.chunks.len(), &big.chunks[..]), (3, &want[..]));
        assert_eq!(big.chunk_crc(2), Some(want[2]));
        assert_eq!(big.chunk_crc(3), None);
        let small = &index.shards[1];
        assert!(small.chunks.is_empty());
        assert_eq!((small.chunk_crc(0), small.chunk_crc(1)), (Some(crc::crc32c(b"tiny")), None));
        assert_eq!(Index::from_bytes(&index.to_bytes()).as_ref(), Some(&index), "chunks persist");
    }

    #[test]
    fn file_trees_skip_hidden_files_and_label_by_first_directory() {
        let dir = generated(SourceFormat::Files, 12);
        std::fs::write(dir.path().join(".hidden"), b"x").unwrap();
        std::fs::write(dir.path().join("top.bin"), b"unlabelled").unwrap();
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        assert_eq!(index.samples.len(), 13);
        let top = index.samples.iter().find(|s| s.key == "top").unwrap();
        assert_eq!((top.label, top.parts[0].ext.as_str()), (NO_LABEL, "bin"));
        assert_eq!(index.classes, vec!["class-0000", "class-0001", "class-0002"]);
        assert_eq!(
            detect(&dir.path().join("nope")).unwrap_err().to_string(),
            format!("{} is not a directory", dir.path().join("nope").display())
        );
    }

    /// A file name that is not UTF-8 cannot be served under its own name (paths are text in the index, the
    /// API and the mount): indexing fails naming the file, escaped, and says why, instead of reporting
    /// that a lossily converted name does not exist.
    #[test]
    fn a_file_name_that_is_not_utf8_is_a_clear_error() {
        use std::os::unix::ffi::OsStrExt;
        let dir = generated(SourceFormat::Files, 4);
        let name = std::ffi::OsStr::from_bytes(b"latin1-\xe9.jpg");
        std::fs::write(dir.path().join("class-0000").join(name), b"bytes").unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("class-0000/latin1-\\xE9.jpg") && err.contains("not UTF-8"), "{err}");
        // A hidden one is skipped like any hidden file.
        std::fs::remove_file(dir.path().join("class-0000").join(name)).unwrap();
        std::fs::write(dir.path().join(std::ffi::OsStr::from_bytes(b".hidden-\xe9")), b"x").unwrap();
        assert_eq!(build(dir.path(), &strict(), &NoProgress).unwrap().samples.len(), 4);
    }

    /// TensorFlow's own shard names carry no extension: `train-00000-of-01024` (ImageNet's build script),
    /// `train.tfrecord-00000-of-00001`. Detected as TFRecord when the first file so named starts with
    /// TFRecord frames; a file so named that does not leaves the dataset a file tree.
    #[test]
    fn tensorflow_shard_names_are_detected_as_tfrecord() {
        let dir = generated(SourceFormat::Tfrecord, 10);
        for (from, to) in [
            ("train-00000-of-00002.tfrecord", "train-00000-of-00002"),
            ("train-00001-of-00002.tfrecord", "train.tfrecord-00001-of-00002"),
        ] {
            std::fs::rename(dir.path().join(from), dir.path().join(to)).unwrap();
        }
        std::fs::write(dir.path().join("README"), b"about").unwrap();
        assert_eq!(detect(dir.path()).unwrap(), SourceFormat::Tfrecord);
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        assert_eq!(index.samples.len(), 10);
        assert_eq!(index.side.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(), ["README"]);
        // One record only: its frame is the whole file.
        let one = tempfile::tempdir().unwrap();
        let mut record = Vec::new();
        tfrecord::encode_record(b"just one", &mut record);
        std::fs::write(one.path().join("eval-00000-of-00001"), &record).unwrap();
        assert_eq!(detect(one.path()).unwrap(), SourceFormat::Tfrecord);
        // An empty first shard (a valid TFRecord file) proves nothing: the first one that holds anything
        // is checked (the dataset was served as a file tree, a shard a sample).
        std::fs::write(one.path().join("eval-00000-of-00001"), b"").unwrap();
        std::fs::write(one.path().join("eval-00001-of-00001"), &record).unwrap();
        assert_eq!(detect(one.path()).unwrap(), SourceFormat::Tfrecord);
        assert_eq!(build(one.path(), &strict(), &NoProgress).unwrap().samples.len(), 1);
        // Text under such a name is a file.
        let text = tempfile::tempdir().unwrap();
        std::fs::write(text.path().join("notes-00000-of-00001"), b"not a TFRecord, only text").unwrap();
        assert_eq!(detect(text.path()).unwrap(), SourceFormat::Files);
        // By names alone (a bucket's listing): such shards are a file tree, and said to be.
        let listed = ["train-00000-of-00002", "train-00001-of-00002", "README"];
        assert_eq!(detect_listed(listed.into_iter()), SourceFormat::Files);
        assert_eq!(unnamed_tfrecord_shard(listed.into_iter()), Some("train-00000-of-00002"));
        assert_eq!(unnamed_tfrecord_shard(["a.tfrecord", "train-00000-of-00001"].into_iter()), None);
        assert_eq!(unnamed_tfrecord_shard(["cat/1.jpg"].into_iter()), None);
        // Beside shards with an extension, such names are side files (a vocabulary, a checkpoint), which
        // indexing strictly would refuse as shards.
        let beside = generated(SourceFormat::Tfrecord, 10);
        for name in ["vocab-00000-of-00001", "model.ckpt-1000.data-00000-of-00001"] {
            std::fs::write(beside.path().join(name), b"not a TFRecord").unwrap();
        }
        let index = build(beside.path(), &strict(), &NoProgress).unwrap();
        assert_eq!(index.samples.len(), 10);
        let side: Vec<&str> = index.side.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(side, ["model.ckpt-1000.data-00000-of-00001", "vocab-00000-of-00001"]);
    }

    /// With the format given, every file of a TFRecord dataset but hidden ones and `.idx` twins is a shard,
    /// whatever its name.
    #[test]
    fn a_given_tfrecord_format_takes_every_file_but_idx_twins_as_a_shard() {
        let dir = generated(SourceFormat::Tfrecord, 10);
        std::fs::rename(dir.path().join("train-00000-of-00002.tfrecord"), dir.path().join("part-a")).unwrap();
        std::fs::rename(dir.path().join("train-00001-of-00002.tfrecord"), dir.path().join("part-b.data")).unwrap();
        std::fs::write(dir.path().join("part-a.idx"), b"0 10\n").unwrap();
        assert_eq!(detect(dir.path()).unwrap(), SourceFormat::Files);
        let given = IndexOptions { format: Some(SourceFormat::Tfrecord), ..strict() };
        let index = build(dir.path(), &given, &NoProgress).unwrap();
        assert_eq!(index.shards.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(), ["part-a", "part-b.data"]);
        assert_eq!(index.side.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(), ["part-a.idx"]);
        assert_eq!(index.samples.len(), 10);
        // Beside shards named as shards, a README stays a side file with the format given too.
        let named = generated(SourceFormat::Tfrecord, 10);
        std::fs::write(named.path().join("README"), b"about these shards").unwrap();
        let index = build(named.path(), &given, &NoProgress).unwrap();
        assert_eq!(index.side.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(), ["README"]);
    }

    /// Compressed tars beside a tar dataset's shards are no shards (their members cannot be served in
    /// place) but side files, and are counted for the warning that says so.
    #[test]
    fn compressed_tars_are_side_files_and_counted() {
        let dir = generated(SourceFormat::Tar, 4);
        std::fs::write(dir.path().join("more-000000.tar.gz"), b"gzip").unwrap();
        std::fs::write(dir.path().join("more-000001.tgz"), b"gzip").unwrap();
        let (shards, side) = discover(dir.path(), SourceFormat::Tar, false).unwrap();
        assert!(shards.iter().all(|s| s.path.ends_with(".tar")) && shards.len() == 2);
        assert_eq!(compressed_shards(&side), ["more-000000.tar.gz", "more-000001.tgz"]);
        // Compressed TFRecord files too (a tree of nothing else was a file tree without a word); other
        // compressed files are no shards.
        let files = ["a.tfrecord.gz", "b.tfrecords.zst", "c.tfr.xz", "d.txt.gz", "e.gz", "f.tar.bz2"]
            .map(|p| ShardInfo { path: p.into(), ..Default::default() });
        assert_eq!(compressed_shards(&files), ["a.tfrecord.gz", "b.tfrecords.zst", "c.tfr.xz", "f.tar.bz2"]);
    }

    /// Shards are taken by their extension in any case (`.TAR` was no shard: a WebDataset dataset of
    /// `SHARD-0.TAR` files was a file tree of whole tars), compressed ones too; the fixed names LMDB and
    /// DALI open (`data.mdb`, `.idx`) only as they are. By names alone, as an object store's dataset is.
    #[test]
    fn shard_extensions_are_taken_in_any_case() {
        let tars = generated(SourceFormat::Tar, 10);
        for (from, to) in [("shard-000000.tar", "SHARD-000000.TAR"), ("shard-000001.tar", "shard-000001.Tar")] {
            std::fs::rename(tars.path().join(from), tars.path().join(to)).unwrap();
        }
        std::fs::write(tars.path().join("old.TAR.GZ"), b"gzip").unwrap();
        let (format, shards, side) = list(tars.path(), &strict()).unwrap();
        assert_eq!(format, SourceFormat::Tar);
        assert_eq!(
            shards.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
            ["SHARD-000000.TAR", "shard-000001.Tar"]
        );
        assert_eq!(compressed_shards(&side), ["old.TAR.GZ"]);
        assert_eq!(build(tars.path(), &strict(), &NoProgress).unwrap().samples.len(), 10);
        let records = generated(SourceFormat::Tfrecord, 10);
        std::fs::rename(records.path().join("train-00000-of-00002.tfrecord"), records.path().join("a.TFRecord"))
            .unwrap();
        std::fs::rename(records.path().join("train-00001-of-00002.tfrecord"), records.path().join("b.TFR")).unwrap();
        assert_eq!(detect(records.path()).unwrap(), SourceFormat::Tfrecord);
        assert_eq!(build(records.path(), &strict(), &NoProgress).unwrap().samples.len(), 10);
        let names = ["x/A.TAR", "y/b.TfRecords", "DATA.MDB", "c.tfrecord.IDX"];
        assert_eq!(detect_listed(names[..1].iter().copied()), SourceFormat::Tar);
        assert_eq!(detect_listed(names[1..].iter().copied()), SourceFormat::Tfrecord);
        assert_eq!(detect_listed(["DATA.MDB", "é.TAR"].into_iter()), SourceFormat::Tar);
        assert!(!has_extension("ü", ".tar") && strip_extension("aé.TAR", ".tar") == Some("aé"));
    }

    /// A sample with two members of one name (`a.jpg`, `a.jpg`, `a.cls`) would hold two `jpg` parts, of
    /// which a wrapping Example keeps only the last, and WebDataset refuses it ("duplicate file name"):
    /// indexing refuses it naming shard, offset and member; skipping, the sample is left out whole.
    #[test]
    fn a_member_repeated_in_a_sample_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = Vec::new();
        for (name, data) in [("b.jpg", &b"other"[..]), ("a.jpg", b"first"), ("a.jpg", b"second"), ("a.cls", b"1")] {
            bytes.extend(tar::file_header(name, data.len() as u64));
            bytes.extend_from_slice(data);
            bytes.resize(bytes.len() + tar::padding(data.len() as u64) as usize, 0);
        }
        bytes.resize(bytes.len() + tar::END_LEN as usize, 0);
        std::fs::write(dir.path().join("shard-0.tar"), &bytes).unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        // The repeated member's header: after two members of one block of data each.
        let at = format!("{} at byte {}", dir.path().join("shard-0.tar").display(), 4 * 512);
        assert!(err.contains(&at) && err.contains("\"a.jpg\"") && err.contains("duplicate"), "{err}");
        let index = build(dir.path(), &skipping(), &NoProgress).unwrap();
        assert_eq!(index.samples.iter().map(|s| s.key.as_str()).collect::<Vec<_>>(), ["b"]);
        assert_eq!(index.skipped.len(), 1);
        // Names that differ in case alone are one name to WebDataset (it reads extensions in lower case, and
        // refused every batch holding both).
        let members: [(&[u8], &[u8], u8, bool); 3] =
            [(b"c.JPG", b"upper", b'0', false), (b"c.jpg", b"lower", b'0', false), (b"d.jpg", b"fine", b'0', false)];
        std::fs::write(dir.path().join("shard-0.tar"), raw_tar(&members)).unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("\"c.jpg\"") && err.contains("duplicate"), "{err}");
    }

    /// A tar of `members` (name bytes, data, type flag), each header's checksum written signed where asked
    /// (as old tars wrote it).
    fn raw_tar(members: &[(&[u8], &[u8], u8, bool)]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for &(name, data, typeflag, signed) in members {
            let mut header = tar::file_header(&"n".repeat(name.len()), data.len() as u64);
            header[..name.len()].copy_from_slice(name);
            header[156] = typeflag;
            header[265..270].copy_from_slice("\u{e9}t\u{e9}".as_bytes()); // an owner of bytes over 127
            header[148..156].fill(b' ');
            let sum = match signed {
                true => header.iter().map(|&b| i64::from(b as i8)).sum::<i64>(),
                false => header.iter().map(|&b| i64::from(b)).sum::<i64>(),
            };
            header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
            bytes.extend(header);
            bytes.extend_from_slice(data);
            bytes.resize(bytes.len() + tar::padding(data.len() as u64) as usize, 0);
        }
        bytes.resize(bytes.len() + tar::END_LEN as usize, 0);
        bytes
    }

    /// Members WebDataset leaves out of every sample (macOS's `._` twins, names without an extension,
    /// `__meta__` names) are left out as it leaves them: they split the samples around them, and became
    /// samples of their own. A header whose checksum was written signed is read, as GNU tar reads it.
    #[test]
    fn members_webdataset_skips_are_left_out_without_splitting_samples() {
        let dir = tempfile::tempdir().unwrap();
        let members: [(&[u8], &[u8], u8, bool); 10] = [
            (b"./._000000.jpg", b"apple", b'0', false),
            (b"./000000.jpg", b"jpeg0", b'0', true),
            (b"./._000000.cls", b"apple", b'0', false),
            (b"./000000.cls", b"3", b'0', false),
            (b"README", b"about", b'0', false),
            (b"__meta__", b"{}", b'0', false),
            (b"x.jpg", b"jpegx", b'0', false),
            (b"dir.v2/noext", b"?", b'0', false),
            (b"x.cls", b"4", b'0', false),
            (b"x/._s4.jpg", b"apple", b'0', false),
        ];
        std::fs::write(dir.path().join("shard-0.tar"), raw_tar(&members)).unwrap();
        let index = build(dir.path(), &strict(), &NoProgress).unwrap();
        let got: Vec<(&str, i64, usize)> =
            index.samples.iter().map(|s| (s.key.as_str(), s.label, s.parts.len())).collect();
        assert_eq!(got, [("./000000", 3, 2), ("x", 4, 2), ("x/", -1, 1)]);
        assert!(index.skipped.is_empty());
    }

    /// A member whose name is not UTF-8 (read lossily, two names became one key: one sample of two) or that
    /// is a sparse file (its stored bytes are not its contents: it was left out of its sample without a
    /// word) is refused naming it; skipping, its sample is left out whole.
    #[test]
    fn members_that_cannot_be_parts_are_refused_or_their_samples_left_out() {
        for (bad, what) in [
            ([(&b"x\xe9.jpg"[..], &b"one"[..], b'0', false), (b"x\xe8.cls", b"7", b'0', false)], "not UTF-8"),
            ([(&b"b.jpg"[..], &b"sparse"[..], b'S', false), (b"b.cls", b"2", b'0', false)], "sparse"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let mut members = vec![(&b"a.jpg"[..], &b"fine"[..], b'0', false), (b"a.cls", b"1", b'0', false)];
            members.extend(bad);
            members.push((b"c.jpg", b"fine too", b'0', false));
            std::fs::write(dir.path().join("shard-0.tar"), raw_tar(&members)).unwrap();
            let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
            assert!(err.contains(what) && err.contains("at byte 2048"), "{err}");
            // A refusal says what is wrong, not what skipping would leave out (it said so as it stopped).
            assert!(!err.contains("left out") && err.contains("pass --skip-corrupt"), "{err}");
            let index = build(dir.path(), &skipping(), &NoProgress).unwrap();
            let keys: Vec<&str> = index.samples.iter().map(|s| s.key.as_str()).collect();
            assert_eq!(keys, ["a", "c"], "{what}");
            assert_eq!(index.skipped.len(), 1, "{what}");
            assert!(index.skipped[0].reason.contains("is left out whole"), "{:?}", index.skipped);
        }
    }

    #[test]
    fn empty_dataset_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = build(dir.path(), &strict(), &NoProgress).unwrap_err().to_string();
        assert!(err.contains("holds no samples"), "{err}");
    }
}
