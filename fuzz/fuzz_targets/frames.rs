//! The HTTP/2 frame reader (what the mount reads from a server's connection) on arbitrary bytes, each
//! header block it completes decoded by HPACK as the mount decodes it (`batchfs::hpack`, its fields
//! compared with `loona-hpack`'s wherever both take the block): never panics, never asks for more than
//! the largest frame allowed, and what it hands out as a stream's DATA lies inside the input.
#![no_main]
use batchfs::frames::{Event, FrameReader, Next, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the largest frame allowed: the least, or the mount's default.
    let Some((&pick, wire)) = data.split_first() else { return };
    let mut reader = FrameReader::new(if pick & 1 == 0 { 16_384 } else { 128 << 10 });
    let max = reader.max_frame() as usize;
    let (mut decoder, mut reference) = (batchfs::hpack::Decoder::default(), loona_hpack::Decoder::new());
    let mut at = 0;
    loop {
        let (n, event) = match reader.next() {
            Next::Head => match wire.get(at..at + HEADER_LEN) {
                Some(b) => (HEADER_LEN, reader.feed(b)),
                None => return,
            },
            Next::Payload(n) => {
                assert!(n <= max);
                match wire.get(at..at + n) {
                    Some(b) => (n, reader.feed(b)),
                    None => return,
                }
            }
            Next::Data { stream, len } => {
                assert!(len <= max && stream != 0);
                if wire.get(at..at + len).is_none() {
                    return;
                }
                (len, Ok(reader.data_read()))
            }
            Next::Skip(n) => {
                assert!(n < 256);
                if wire.get(at..at + n).is_none() {
                    return;
                }
                (n, Ok(reader.skipped()))
            }
        };
        at += n;
        match event {
            Err(_) => return,
            Ok(Some(Event::Headers { block, .. })) => {
                let mut ours = Vec::new();
                if decoder.decode(&block, |n, v| ours.push((n.to_vec(), v.to_vec()))).is_err() {
                    return;
                }
                let mut theirs = Vec::new();
                if reference.decode_with_cb(&block, |n, v| theirs.push((n.to_vec(), v.to_vec()))).is_err() {
                    // A strictness ours lacks: the tables may differ from here on.
                    return;
                }
                assert_eq!(ours, theirs, "a header block decoded otherwise than by the reference");
            }
            Ok(_) => {}
        }
    }
});
