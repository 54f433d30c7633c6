//! A WebDataset tar's indexing: members grouped into samples by key (WebDataset's rule), labels read from
//! `.cls`-like parts, a repeated member or a damaged header skipped or refused as `skip_corrupt` says.

use super::{corrupt, each_shard_read, reuse, Files, IndexError, Progress};
use crate::index::{Exts, Index, Part, Sample, NO_LABEL};
use crate::{crc, tar};

/// A tar member's key and extension as WebDataset's reader gives them, or none where it leaves the member
/// out of every sample. Its rule, `^((?:.*/|)[^.]+)[.]([^/]*)$`: the longest directory part whose rest
/// starts with a run of no dots, then a dot, then an extension without `/` (so mostly the path up to the
/// first `.` of the file name: `a/b/000123.jpg` is `a/b/000123` and `jpg`; a file name without a `.` or
/// starting with one, macOS's `._NAME` twins, has none at the top, and `dir/._x.jpg` is key `dir/`);
/// and its metadata names (`__*__` first) are in no sample.
pub fn split_key(name: &str) -> Option<(&str, &str)> {
    // `__[^/]*__` at the start, then the end or a `/`: the first component is `__...__`.
    let first = name.split('/').next().unwrap_or(name);
    if first.len() >= 4 && first.starts_with("__") && first.ends_with("__") {
        return None;
    }
    // Where the run of no dots may start: after each `/`, the last first, then the very start.
    let starts = name.match_indices('/').map(|(i, _)| i + 1).rev().chain([0]);
    starts.into_iter().find_map(|start| {
        let rest = &name[start..];
        let dot = rest.find('.').filter(|&d| d > 0)?;
        let ext = &rest[dot + 1..];
        (!ext.contains('/')).then(|| (&name[..start + dot], ext))
    })
}

/// Parses a label out of a small text part (`.cls`, `.label`): a decimal integer, surrounding space ignored.
pub(super) fn text_label(bytes: &[u8]) -> Option<i64> {
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}

const LABEL_EXTS: [&str; 3] = ["cls", "label", "cls2"];

/// The members of one WebDataset sample, while a shard's members are grouped by key.
struct Group {
    key: String,
    parts: Vec<Part>,
}

pub(super) fn index(
    files: &dyn Files,
    index: &mut Index,
    reuse: Option<&reuse::Previous>,
    progress: &dyn Progress,
) -> Result<(), IndexError> {
    let mut exts = Exts::default();
    let (mut skipped_members, mut left_out) = (0u64, None::<String>);
    each_shard_read(files, index, reuse, progress, |index, shard_no, shard, bytes| {
        let mut group: Option<Group> = None;
        let flush = |group: &mut Option<Group>, index: &mut Index| {
            if let Some(Group { key, parts }) = group.take() {
                let label = LABEL_EXTS
                    .iter()
                    .find_map(|ext| {
                        let p = parts.iter().find(|p| p.ext == *ext)?;
                        text_label(&bytes[p.offset as usize..(p.offset + p.len) as usize])
                    })
                    .unwrap_or(NO_LABEL);
                index.samples.push(Sample { key: key.into(), label, parts: parts.into() });
            }
        };
        let mut reported = 0;
        // The key of a sample left out for a repeated member (with `skip_corrupt`): its later members are
        // left out with it.
        let mut dropped: Option<String> = None;
        for item in tar::Scanner::new(bytes) {
            match item {
                Ok(member) => {
                    let done = member.data_offset + member.size;
                    let Some((key, ext)) = split_key(&member.name) else {
                        // Left out as WebDataset leaves it out, without ending the sample being grouped.
                        left_out.get_or_insert_with(|| member.name.clone());
                        skipped_members += 1;
                        progress.advance(done - reported);
                        reported = done;
                        continue;
                    };
                    if group.as_ref().is_some_and(|g| g.key != key) {
                        flush(&mut group, index);
                    }
                    if dropped.as_deref().is_some_and(|d| d != key) {
                        dropped = None;
                    }
                    // Two parts of one extension: a wrapping Example would keep only the last, WebDataset
                    // refuses the tar ("duplicate file name"), and which one is meant cannot be known.
                    // WebDataset reads extensions in lower case: `a.JPG` and `a.jpg` are one name to it.
                    let lower = ext.to_lowercase();
                    let repeated =
                        group.as_ref().is_some_and(|g| g.parts.iter().any(|p| p.ext.to_lowercase() == lower));
                    // A member that cannot be a part (a name not UTF-8, read lossily, may have merged two
                    // keys into one; a sparse file's bytes are not its contents): its sample is left out.
                    if repeated || member.unusable.is_some() || dropped.is_some() {
                        let why = match member.unusable {
                            _ if dropped.is_some() => None,
                            Some(why) => Some(format!("member {:?} {why}", member.name)),
                            None => Some(format!(
                                "member {:?} repeats a member of sample {key:?} (a duplicate file name, which \
                                 WebDataset refuses too)",
                                member.name
                            )),
                        };
                        group.take();
                        if let Some(why) = why {
                            let skipping = format!("the sample {key:?} is left out whole");
                            corrupt(index, files.root(), (&shard.path, member.header_offset), why, &skipping)?;
                            dropped = Some(key.to_owned());
                        }
                        progress.advance(done - reported);
                        reported = done;
                        continue;
                    }
                    let data = &bytes[member.data_offset as usize..(member.data_offset + member.size) as usize];
                    let part = Part {
                        ext: exts.get(ext),
                        shard: shard_no as u32,
                        offset: member.data_offset,
                        len: member.size,
                        crc32c: crc::crc32c(data),
                    };
                    group.get_or_insert_with(|| Group { key: key.to_owned(), parts: Vec::new() }).parts.push(part);
                    progress.advance(done - reported);
                    reported = done;
                }
                Err(e) => {
                    let offset = match &e {
                        tar::TarError::BadChecksum { offset }
                        | tar::TarError::Truncated { offset, .. }
                        | tar::TarError::BadNumber { offset, .. }
                        | tar::TarError::BadPax { offset }
                        | tar::TarError::TruncatedHeader { offset } => *offset,
                    };
                    // The sample being grouped is complete only if the failed member starts another
                    // key; when that cannot be known (a damaged header, or a member of no key, left out
                    // without ending the sample: more of its members may have followed), it is dropped
                    // too rather than served with a part missing.
                    let mut skipping = "the rest of the shard is skipped".to_owned();
                    let complete = match &e {
                        tar::TarError::Truncated { name, .. } => {
                            group.as_ref().is_some_and(|g| split_key(name).is_some_and(|(key, _)| g.key != key))
                        }
                        _ => false,
                    };
                    if complete {
                        flush(&mut group, index);
                    } else if let Some(g) = group.take() {
                        skipping.push_str(&format!(", with sample {:?} whose members may be incomplete", g.key));
                    }
                    corrupt(index, files.root(), (&shard.path, offset), e.to_string(), &skipping)?;
                }
            }
        }
        flush(&mut group, index);
        progress.advance(shard.size.saturating_sub(reported));
        Ok(())
    })?;
    if let Some(first) = left_out {
        tracing::warn!(
            dataset = %files.root().display(), members = skipped_members, first = %first,
            "tar members WebDataset skips (a name without an extension, a hidden name such as macOS's ._ \
             files, or a __meta__ name) are left out of the samples, as WebDataset leaves them out"
        );
    }
    Ok(())
}
