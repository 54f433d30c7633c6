#!/usr/bin/env python3
"""Reads batch files with the Python tools users load them with, and prints what they saw as JSON.

    read_batches.py tfrecord BATCH.tfrecord BATCH.tfrecord.idx
        The `tfrecord` package: its tfrecord2idx must write our .idx byte for byte, its loader must parse
        every tf.train.Example (Google's protobuf); every frame's masked CRC32Cs are checked here.
    read_batches.py tar BATCH.tar
        Python's tarfile, then WebDataset's grouping of members into samples.

Every byte string is reported as its CRC32C, so the Rust test can compare with the source samples.
"""
import json
import struct
import sys
import tarfile

import crc32c


def mask(crc):
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def check_frames(path):
    data = open(path, "rb").read()
    pos, frames = 0, 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        assert mask(crc32c.crc32c(data[pos:pos + 8])) == length_crc, f"bad length CRC at {pos}"
        (data_crc,) = struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])
        assert mask(crc32c.crc32c(data[pos + 12:pos + 12 + n])) == data_crc, f"bad data CRC at {pos}"
        pos += 16 + n
        frames += 1
    assert pos == len(data), "trailing bytes"
    return frames


def read_tfrecord(path, idx_path):
    from tfrecord.reader import tfrecord_loader
    from tfrecord.tools.tfrecord2idx import create_index

    frames = check_frames(path)
    create_index(path, path + ".py.idx")
    same_index = open(path + ".py.idx", "rb").read() == open(idx_path, "rb").read()
    records = []
    # Without an index: with one and no shard, the loader starts at a random record.
    for example in tfrecord_loader(path, None, None):
        record = {}
        for name, value in example.items():
            if isinstance(value, bytes):
                record[name] = crc32c.crc32c(value)
            elif value.dtype.kind == "u":  # bytes features may come back as uint8 arrays
                record[name] = crc32c.crc32c(value.tobytes())
            else:
                record[name] = [int(v) for v in value]
        records.append(record)
    return {"frames": frames, "same_index": same_index, "records": records}


def read_tar(path):
    import webdataset as wds

    with tarfile.open(path) as tar:
        members = [[m.name, crc32c.crc32c(tar.extractfile(m).read())] for m in tar.getmembers()]
    samples = []
    for sample in wds.WebDataset(path, shardshuffle=False):
        samples.append({k: (v if k.startswith("__") else crc32c.crc32c(v)) for k, v in sample.items() if k not in ("__url__", "__local_path__")})
    return {"members": members, "samples": samples}


if __name__ == "__main__":
    mode = sys.argv[1]
    out = read_tfrecord(sys.argv[2], sys.argv[3]) if mode == "tfrecord" else read_tar(sys.argv[2])
    json.dump(out, sys.stdout)
