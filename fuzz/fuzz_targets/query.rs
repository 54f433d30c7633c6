//! The request parsers (path, query string, Range header): never panic; a parsed query re-serializes to
//! itself; a partial range lies inside the body.
#![no_main]
use batchfs::api::{parse_range, BatchQuery, RangeRequest, Route};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (&str, &str, &str, u32)| {
    let (path, query, range, len) = input;
    let _ = Route::parse(path);
    if let Ok(q) = BatchQuery::parse(query) {
        assert_eq!(BatchQuery::parse(&q.to_query()), Ok(q));
    }
    if let RangeRequest::Partial { start, end } = parse_range(Some(range), u64::from(len)) {
        assert!(start < end && end <= u64::from(len));
    }
});
