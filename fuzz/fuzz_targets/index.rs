//! The persisted-index reader on arbitrary files: never panics; anything it accepts survives a
//! write-and-read round trip unchanged.
#![no_main]
use batchfs::index::Index;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(index) = Index::from_bytes(data) {
        assert_eq!(Index::from_bytes(&index.to_bytes()), Some(index));
    }
});
