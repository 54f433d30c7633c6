//! HPACK header blocks (a server's response heads) decoded in turn over one connection's table by the
//! mount's decoder (`batchfs::hpack`) and by `loona-hpack`: never a panic, and wherever both take a
//! block, the same fields in the same order. The input is a run of blocks, each after its length (two
//! bytes, big-endian).
#![no_main]
use batchfs::hpack::Decoder;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (mut ours, mut reference) = (Decoder::default(), loona_hpack::Decoder::new());
    let mut rest = data;
    while let [a, b, tail @ ..] = rest {
        let len = u16::from_be_bytes([*a, *b]) as usize;
        let Some(block) = tail.get(..len) else { return };
        rest = &tail[len..];
        let mut got = Vec::new();
        if ours.decode(block, |n, v| got.push((n.to_vec(), v.to_vec()))).is_err() {
            return;
        }
        let mut want = Vec::new();
        if reference.decode_with_cb(block, |n, v| want.push((n.to_vec(), v.to_vec()))).is_err() {
            // A strictness ours lacks (a block that ends in a size update): the tables may differ now.
            return;
        }
        assert_eq!(got, want, "a header block decoded otherwise than by the reference");
    }
});
