#!/usr/bin/env python3
"""Reads one epoch directory with a real data loader, default settings, and prints what it saw as JSON.

    loaders.py dali DIR [--no-mmap]     NVIDIA DALI fn.readers.tfrecord over DIR/*.tfrecord and their .idx
                                        twins (CPU only: device_id=None), batch_size 128, 4 threads
    loaders.py torch DIR                PyTorch DataLoader, 4 worker processes, batch_size=None: each item
                                        is one batch file read whole (Debian's python3-torch); in a
                                        directory without batch files, each *.tfrecord shard
    loaders.py wds DIR                  webdataset.WebDataset over DIR/*.tar
    loaders.py dali-wds DIR [--no-mmap] NVIDIA DALI fn.readers.webdataset over DIR/*.tar (ext jpg;cls), no
                                        index files (DALI parses the tars when its pipeline is built)
    loaders.py tfdata DIR               tf.data.TFRecordDataset over DIR/*.tfrecord, each record parsed by
                                        tf.io.parse_single_example (pip's tensorflow-cpu)
    loaders.py tfrecord DIR             the tfrecord package's reader over DIR/*.tfrecord, file after
                                        file, no index
    loaders.py imagefolder DIR          torchvision.datasets.ImageFolder over the class folders of DIR, read by
                                        a DataLoader with shuffle=True and 4 worker processes, batch_size=None
                                        (each item one file read whole; Debian's python3-torchvision)
    loaders.py lmdb DIR [--lock]        the lmdb package: the environment DIR (DIR/data.mdb) opened
                                        read-only, lock=False (with --lock, lock=True: LMDB then finds the
                                        filesystem read-only and goes on without a lock file), every
                                        record in key order by a cursor

Options:
    --epochs N          (dali, dali-wds, wds, tfdata, tfrecord, imagefolder) one pipeline built once, run for N
                        epochs over the same files (a
                        directory such as rolling/ serves a new epoch at each pass); records of all
                        epochs, in order
    --limit N           (imagefolder) stop after N items (a slow path's rate, without a whole epoch)
    --shard K/N         (dali) read shard K of N (shard_id, num_shards) with stick_to_shard=True, as one
                        node of a data-parallel job does
    --consume-mbps R    a consumer at R MB/s (a GPU step per batch) that overlaps with loading, as training
                        does; without it the loader runs as fast as it can
    --records           also list every sample as [key, label, crc32c] (dali, dali-wds, wds, tfdata,
                        tfrecord; with the file it came from, as a fourth item, for tfdata and
                        tfrecord) or every file as
                        [name, bytes, crc32c] (torch) or every record as [key, bytes, crc32c] (lmdb)
                        or every item as [class, bytes, crc32c, epoch] (imagefolder),
                        in the order the loader delivered them

The JSON: loader, samples, bytes, build_s (pipeline build, for DALI: reading the .idx twins), cpu_s (CPU
seconds from the clock's start, worker processes included once joined), epoch_s
(build included), records if asked. Files are taken in name order, as a user's glob would list them.
"""
import glob
import json
import os
import sys
import time


class Consumer:
    """A consumer of `rate` bytes/s: each batch takes its bytes / rate, overlapping with the loader."""

    def __init__(self, mbps):
        self.rate = mbps * 1e6 if mbps else None
        self.busy_until = 0.0

    def consume(self, nbytes):
        if not self.rate:
            return
        now = time.monotonic()
        start = max(now, self.busy_until)
        self.busy_until = start + nbytes / self.rate
        # The training step runs on a device; here it is a sleep. The loader keeps loading meanwhile
        # (DALI's prefetch queue, DataLoader's workers, our reads ahead).
        time.sleep(max(0.0, self.busy_until - time.monotonic()))


def _crc32c_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


def crc(data):
    """CRC32C: the crc32c package where installed (pip), else a slow table in Python (Debian's
    interpreter, which torch is installed for, cannot take pip packages; tests keep files small)."""
    try:
        import crc32c

        return crc32c.crc32c(data)
    except ImportError:
        global _TABLE
        if "_TABLE" not in globals():
            _TABLE = _crc32c_table()
        c = 0xFFFFFFFF
        for b in data:
            c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
        return c ^ 0xFFFFFFFF


def run_dali(directory, mmap, consumer, want_records, epochs=1, shard=(0, 1)):
    from nvidia.dali import fn, pipeline_def
    import nvidia.dali.tfrecord as tfrec

    files = sorted(glob.glob(os.path.join(directory, "*.tfrecord")))
    idx = [f + ".idx" for f in files]
    started = time.monotonic()

    @pipeline_def(batch_size=128, num_threads=4, device_id=None)
    def pipe():
        out = fn.readers.tfrecord(
            path=files,
            index_path=idx,
            features={
                "image/encoded": tfrec.FixedLenFeature((), tfrec.string, ""),
                "image/class/label": tfrec.FixedLenFeature([1], tfrec.int64, -1),
                "image/filename": tfrec.FixedLenFeature((), tfrec.string, ""),
            },
            dont_use_mmap=not mmap,
            shard_id=shard[0],
            num_shards=shard[1],
            stick_to_shard=shard[1] > 1,
            name="Reader",
        )
        images = out["image/encoded"]
        return images, images.shape(), out["image/class/label"], out["image/filename"]

    p = pipe()
    p.build()
    build_s = time.monotonic() - started
    # The reader runs on past an epoch's end into the next pass; the shard's share of an epoch is its
    # samples per pass.
    n = p.epoch_size("Reader")
    total = (n * (shard[0] + 1) // shard[1] - n * shard[0] // shard[1]) * epochs
    samples, nbytes, records = 0, 0, []
    while samples < total:
        images, sizes, labels, names = p.run()
        # Per-sample Python only where records are asked for: the timed path stays I/O-bound.
        take = min(len(images), total - samples)
        batch_bytes = int(sizes.as_array()[:take].sum())
        if want_records:
            for i in range(take):
                image = images.at(i)
                records.append([bytes(names.at(i)).decode(), int(labels.at(i)[0]), crc(image.tobytes())])
        samples += take
        nbytes += batch_bytes
        consumer.consume(batch_bytes)
    return samples, nbytes, build_s, records


class BatchFiles:
    """A map-style dataset: item i is batch file i, read whole."""

    def __init__(self, files, want_records):
        self.files = files
        self.want_records = want_records

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            data = f.read()
        return os.path.basename(self.files[i]), len(data), crc(data) if self.want_records else 0


def run_torch(directory, consumer, want_records):
    import torch.utils.data

    files = sorted(f for f in glob.glob(os.path.join(directory, "batch-*")) if not f.endswith(".idx"))
    # A directory of original shards (a bucket mounted by s3fs or rclone) rather than of batch files.
    files = files or sorted(glob.glob(os.path.join(directory, "*.tfrecord")))
    started = time.monotonic()
    loader = torch.utils.data.DataLoader(BatchFiles(files, want_records), batch_size=None, num_workers=4)
    build_s = time.monotonic() - started
    samples, nbytes, records = 0, 0, []
    for name, size, checksum in loader:
        samples += 1
        nbytes += size
        if want_records:
            records.append([name, size, checksum])
        consumer.consume(size)
    return samples, nbytes, build_s, records


def read_whole(path):
    """ImageFolder's loader: the file's bytes (a decoder would come next in training)."""
    with open(path, "rb") as f:
        return f.read()


class Checked:
    """An ImageFolder item as the worker made it: the class and the bytes' size and CRC32C (the workers
    compute the CRC, as they would decode, so the parent does not carry every byte)."""

    def __init__(self, folder, want_records):
        self.folder = folder
        self.want_records = want_records

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, i):
        data, target = self.folder[i]
        return self.folder.classes[target], len(data), crc(data) if self.want_records else 0


def run_imagefolder(directory, consumer, want_records, epochs=1, limit=None):
    import torch.utils.data
    import torchvision

    started = time.monotonic()
    folder = torchvision.datasets.ImageFolder(directory, loader=read_whole)
    loader = torch.utils.data.DataLoader(Checked(folder, want_records), batch_size=None, shuffle=True, num_workers=4)
    build_s = time.monotonic() - started
    samples, nbytes, records = 0, 0, []
    for epoch in range(epochs):
        for name, size, checksum in loader:
            samples += 1
            nbytes += size
            if want_records:
                records.append([name, size, checksum, epoch])
            consumer.consume(size)
            if limit and samples >= limit:
                return samples, nbytes, build_s, records
    return samples, nbytes, build_s, records


def run_wds(directory, consumer, want_records, epochs=1):
    import webdataset as wds

    files = sorted(glob.glob(os.path.join(directory, "*.tar")))
    started = time.monotonic()
    dataset = wds.WebDataset(files, shardshuffle=False)
    build_s = time.monotonic() - started
    samples, nbytes, records = 0, 0, []
    for sample in (s for _ in range(epochs) for s in dataset):
        payload = [k for k in sorted(sample) if not k.startswith("__") and k not in ("cls", "key")]
        size = sum(len(sample[k]) for k in payload)
        samples += 1
        nbytes += size
        if want_records:
            label = int(sample["cls"]) if "cls" in sample else -1
            records.append([sample["__key__"], label, crc(sample[payload[0]]) if payload else 0])
        consumer.consume(size)
    return samples, nbytes, build_s, records


def run_dali_wds(directory, mmap, consumer, want_records, epochs=1):
    from nvidia.dali import fn, pipeline_def

    files = sorted(glob.glob(os.path.join(directory, "*.tar")))
    started = time.monotonic()

    @pipeline_def(batch_size=128, num_threads=4, device_id=None)
    def pipe():
        jpg, cls = fn.readers.webdataset(
            paths=files, ext=["jpg", "cls"], dont_use_mmap=not mmap, missing_component_behavior="error",
            name="Reader",
        )
        return jpg, jpg.shape(), cls

    p = pipe()
    p.build()
    build_s = time.monotonic() - started
    total = p.epoch_size("Reader") * epochs
    samples, nbytes, records = 0, 0, []
    while samples < total:
        images, sizes, labels = p.run()
        take = min(len(images), total - samples)
        batch_bytes = int(sizes.as_array()[:take].sum())
        if want_records:
            for i in range(take):
                # The source info is "path:offset:member", the member KEY.jpg.
                key = images[i].source_info().rsplit(":", 1)[-1].rsplit(".", 1)[0]
                label = int(bytes(labels.at(i)).decode())
                records.append([key, label, crc(images.at(i).tobytes())])
        samples += take
        nbytes += batch_bytes
        consumer.consume(batch_bytes)
    return samples, nbytes, build_s, records


def run_tfdata(directory, consumer, want_records, epochs=1):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    files = sorted(glob.glob(os.path.join(directory, "*.tfrecord")))
    features = {
        "image/encoded": tf.io.FixedLenFeature([], tf.string),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        "image/filename": tf.io.FixedLenFeature([], tf.string),
    }
    started = time.monotonic()
    # One dataset, built once: each pass reads the same files again, as a training loop's epochs do.
    names = tf.data.Dataset.from_tensor_slices(files)
    dataset = names.flat_map(
        lambda f: tf.data.TFRecordDataset(f).map(lambda r: (tf.io.parse_single_example(r, features), f))
    )
    build_s = time.monotonic() - started
    samples, nbytes, records = 0, 0, []
    for _ in range(epochs):
        for example, name in dataset:
            image = example["image/encoded"].numpy()
            samples += 1
            nbytes += len(image)
            if want_records:
                key = example["image/filename"].numpy().decode()
                label = int(example["image/class/label"].numpy())
                records.append([key, label, crc(image), os.path.basename(name.numpy().decode())])
            consumer.consume(len(image))
    return samples, nbytes, build_s, records


def run_tfrecord(directory, consumer, want_records, epochs=1):
    from tfrecord.reader import tfrecord_loader

    files = sorted(glob.glob(os.path.join(directory, "*.tfrecord")))
    description = {"image/encoded": "byte", "image/class/label": "int", "image/filename": "byte"}
    started = time.monotonic()
    build_s = time.monotonic() - started
    samples, nbytes, records = 0, 0, []
    for _ in range(epochs):
        for path in files:
            for example in tfrecord_loader(path, None, description):
                image = bytes(example["image/encoded"])
                samples += 1
                nbytes += len(image)
                if want_records:
                    key = bytes(example["image/filename"]).decode()
                    label = int(example["image/class/label"][0])
                    records.append([key, label, crc(image), os.path.basename(path)])
                consumer.consume(len(image))
    return samples, nbytes, build_s, records


def run_lmdb(directory, consumer, want_records, lock):
    import lmdb

    started = time.monotonic()
    env = lmdb.open(directory, readonly=True, lock=lock)
    build_s = time.monotonic() - started
    samples, nbytes, records = 0, 0, []
    with env.begin() as txn:
        for key, value in txn.cursor():
            samples += 1
            nbytes += len(value)
            if want_records:
                records.append([key.decode("utf-8", "replace"), len(value), crc(value)])
            consumer.consume(len(value))
    env.close()
    return samples, nbytes, build_s, records


def cpu_seconds():
    """CPU seconds (user + system) of this process and of the children it has waited for."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv):
    known = ("dali", "dali-wds", "torch", "wds", "lmdb", "tfdata", "tfrecord", "imagefolder")
    if len(argv) < 3 or argv[1] not in known:
        sys.exit(__doc__)
    loader, directory = argv[1], argv[2]
    rest = argv[3:]
    mbps = None
    if "--consume-mbps" in rest:
        mbps = float(rest[rest.index("--consume-mbps") + 1])
    want = "--records" in rest
    epochs = int(rest[rest.index("--epochs") + 1]) if "--epochs" in rest else 1
    shard = (0, 1)
    if "--shard" in rest:
        k, n = rest[rest.index("--shard") + 1].split("/")
        shard = (int(k), int(n))
    consumer = Consumer(mbps)
    # Imported before the clock starts: a training job has its loader imported long before an epoch.
    modules = {"dali": "nvidia.dali", "dali-wds": "nvidia.dali", "torch": "torch.utils.data", "wds": "webdataset",
               "lmdb": "lmdb", "tfdata": "tensorflow", "tfrecord": "tfrecord", "imagefolder": "torchvision"}
    if loader == "tfdata":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    __import__(modules[loader])
    cpu_before = cpu_seconds()
    started = time.monotonic()
    if loader == "dali":
        samples, nbytes, build_s, records = run_dali(
            directory, "--no-mmap" not in rest, consumer, want, epochs, shard
        )
    elif loader == "torch":
        samples, nbytes, build_s, records = run_torch(directory, consumer, want)
    elif loader == "dali-wds":
        samples, nbytes, build_s, records = run_dali_wds(directory, "--no-mmap" not in rest, consumer, want, epochs)
    elif loader == "tfdata":
        samples, nbytes, build_s, records = run_tfdata(directory, consumer, want, epochs)
    elif loader == "tfrecord":
        samples, nbytes, build_s, records = run_tfrecord(directory, consumer, want, epochs)
    elif loader == "imagefolder":
        limit = int(rest[rest.index("--limit") + 1]) if "--limit" in rest else None
        samples, nbytes, build_s, records = run_imagefolder(directory, consumer, want, epochs, limit)
    elif loader == "lmdb":
        samples, nbytes, build_s, records = run_lmdb(directory, consumer, want, "--lock" in rest)
    else:
        samples, nbytes, build_s, records = run_wds(directory, consumer, want, epochs)
    out = {
        "loader": loader + (" no-mmap" if "--no-mmap" in rest else ""),
        "samples": samples,
        "bytes": nbytes,
        "build_s": round(build_s, 4),
        "epoch_s": round(time.monotonic() - started, 4),
        # From the clock's start: the loader's threads and the worker processes it has joined.
        "cpu_s": round(cpu_seconds() - cpu_before, 4),
    }
    if want:
        out["records"] = records
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
