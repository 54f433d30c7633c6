//! The protobuf walker on arbitrary messages (tf.train.Example and Caffe Datum): never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for name in ["label", "image/class/label", "key", "image/filename"] {
        let _ = batchfs::proto::example_feature(data, name);
    }
    let _ = batchfs::proto::datum_label(data);
});
