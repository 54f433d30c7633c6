//! The request parsers (path, query string, Range header) and the mount's parser of a response's
//! checkpoints header: never panic; a parsed query re-serializes to itself; a partial range lies inside
//! the body; parsed checkpoints increase and re-serialize to themselves. The input is text: the path, the
//! query string, the Range header, the body length and the checkpoints header, one per line (the seeds in
//! fuzz/seeds/query are real requests).
#![no_main]
use batchfs::api::{format_checkpoints, parse_checkpoints, parse_range, BatchQuery, RangeRequest, Route};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut lines = text.split('\n');
    let (path, query, range) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""), lines.next().unwrap_or(""));
    let len: u64 = lines.next().and_then(|l| l.trim().parse().ok()).unwrap_or(0);
    if let Some(checkpoints) = parse_checkpoints(lines.next().unwrap_or("")) {
        assert!(checkpoints[0].0 > 0 && checkpoints.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(parse_checkpoints(&format_checkpoints(&checkpoints)), Some(checkpoints));
    }
    let _ = Route::parse(path);
    if let Ok(q) = BatchQuery::parse(query) {
        assert_eq!(BatchQuery::parse(&q.to_query()), Ok(q));
    }
    if let RangeRequest::Partial { start, end } = parse_range(Some(range), len) {
        assert!(start < end && end <= len);
    }
});
