//! A local dataset's files as indexing lists them: the walk of its directory (links followed, hidden
//! names and indexes left out) and the dates an index records.

use super::{io_err, IndexError};
use crate::index::ShardInfo;
use std::io;
use std::path::Path;
use std::time::UNIX_EPOCH;

/// Lists regular files under `root` (hidden names skipped), sorted by path. Symbolic links are followed, as
/// readers follow them (a dataset made of links to shards elsewhere: they were left out without a word),
/// those that lead out of `root` only where `out_too` says (else left out with a warning: a link planted
/// in a dataset would serve any file the server can read): a link to a file is that file under the link's
/// name, a link to a directory that directory, each directory listed once, under its own name where the
/// tree reaches it without a link (links to directories are walked after every other directory: `latest ->
/// train` took `train/`'s files and their class); a link that leads to no file (to nothing, or in a loop
/// of links, which stopped the server) is left out with a warning. Indexes (`*.batchfs-index`, an
/// `index_dir` inside the dataset) are no files of it. A name that is not UTF-8 is an error: paths are text
/// in the index, the API and the mount, and a name converted lossily would name no file.
pub(super) fn walk(root: &Path, out_too: bool) -> Result<Vec<ShardInfo>, IndexError> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let top = std::fs::metadata(root).map_err(io_err(root))?;
    let inside = std::fs::canonicalize(root).map_err(io_err(root))?;
    let mut seen = std::collections::HashSet::from([(top.dev(), top.ino())]);
    let mut stack = vec![(root.to_owned(), String::new())];
    let mut linked = std::collections::VecDeque::new();
    let listed_already = |path: &Path| tracing::warn!(path = %path.display(), "a directory listed already: left out");
    loop {
        let next = stack.pop().or_else(|| {
            while let Some((path, rel, id)) = linked.pop_front() {
                match seen.insert(id) {
                    true => return Some((path, rel)),
                    false => listed_already(&path),
                }
            }
            None
        });
        let Some((dir, rel)) = next else { break };
        // In order of name: the listing is the same at every start.
        let mut entries =
            std::fs::read_dir(&dir).and_then(Iterator::collect::<io::Result<Vec<_>>>).map_err(io_err(&dir))?;
        entries.sort_by_key(std::fs::DirEntry::file_name);
        for entry in entries {
            let name = entry.file_name();
            if name.as_encoded_bytes().starts_with(b".") {
                continue;
            }
            let path = entry.path();
            let name = name.into_string().map_err(|_| IndexError::NotUtf8 { path: path.clone() })?;
            let link = entry.file_type().is_ok_and(|t| t.is_symlink());
            let meta = match std::fs::metadata(&path) {
                Ok(meta) => meta,
                Err(e) if link => {
                    tracing::warn!(path = %path.display(), error = %e, "a symbolic link to no file: left out");
                    continue;
                }
                Err(e) => return Err(io_err(&path)(e)),
            };
            if link && !out_too {
                match std::fs::canonicalize(&path) {
                    Ok(target) if target.starts_with(&inside) => {}
                    target => {
                        let to = target.map_or_else(|e| e.to_string(), |t| t.display().to_string());
                        tracing::warn!(path = %path.display(), to, "a symbolic link out of the dataset's directory: \
                                       left out (--follow-links, or follow_links in the config, follows it)");
                        continue;
                    }
                }
            }
            let rel_path = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            if meta.is_dir() {
                let id = (meta.dev(), meta.ino());
                if link {
                    linked.push_back((path, rel_path, id));
                } else if seen.insert(id) {
                    stack.push((path, rel_path));
                } else {
                    listed_already(&path);
                }
            } else if meta.is_file() && !rel_path.ends_with(".batchfs-index") {
                let mtime_ns = modified_ns(&meta);
                out.push(ShardInfo { path: rel_path.into(), size: meta.len(), mtime_ns, ..Default::default() });
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// The modification time an index records for a file (a link's target's: a link re-created to the same
/// file is no change), nanoseconds since the epoch, 0 before it; the server compares a shard with it as it
/// serves. (A link pointed at another file of the same size and date is not seen, as a file rewritten in
/// place keeping both is not: outside the contract, docs/FORMATS.md.)
pub fn modified_ns(meta: &std::fs::Metadata) -> i64 {
    meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos() as i64)
}
