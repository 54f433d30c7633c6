//! The tar scanner on arbitrary archives: never panics, and every member's data lies inside the input.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for member in batchfs::tar::Scanner::new(data).flatten() {
        assert!(member.data_offset + member.size <= data.len() as u64);
        let _ = batchfs::source::split_key(&member.name);
    }
});
