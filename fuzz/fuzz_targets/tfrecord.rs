//! The TFRecord scanner on arbitrary shards: never panics, every record it yields lies inside the input
//! and, when data CRCs are verified, has a matching CRC.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for verify in [false, true] {
        for record in batchfs::tfrecord::Scanner::new(data, verify).flatten() {
            let end = record.data_offset() + record.len + batchfs::tfrecord::FOOTER_LEN;
            assert!(end <= data.len() as u64);
            let payload = &data[record.data_offset() as usize..(record.data_offset() + record.len) as usize];
            if verify {
                assert_eq!(batchfs::crc::crc32c(payload), record.data_crc);
            }
        }
    }
});
