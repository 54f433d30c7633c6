//! The request parsers (path, query string, Range header): never panic; a parsed query re-serializes to
//! itself; a partial range lies inside the body. The input is text: the path, the query string, the
//! Range header and the body length, one per line (the seeds in fuzz/seeds/query are real requests).
#![no_main]
use batchfs::api::{parse_range, BatchQuery, RangeRequest, Route};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut lines = text.split('\n');
    let (path, query, range) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""), lines.next().unwrap_or(""));
    let len: u64 = lines.next().and_then(|l| l.trim().parse().ok()).unwrap_or(0);
    let _ = Route::parse(path);
    if let Ok(q) = BatchQuery::parse(query) {
        assert_eq!(BatchQuery::parse(&q.to_query()), Ok(q));
    }
    if let RangeRequest::Partial { start, end } = parse_range(Some(range), len) {
        assert!(start < end && end <= len);
    }
});
