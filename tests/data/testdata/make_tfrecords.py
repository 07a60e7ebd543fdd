"""Writes the TFRecord test files data_test reads back (run once with TensorFlow 2.21; the files
are committed). TensorFlow's own writer and encoders make them, so the test checks dtrain against
what TF users already have on disk:

    build/peers-venv/bin/python tests/data/testdata/make_tfrecords.py tests/data/testdata

tf_examples_0.tfrecord (5 records) and tf_examples_1.tfrecord (3 records) hold tf.train.Examples with
"image/encoded" (a JPEG in file 0, a PNG in file 1, of a 6x8 RGB image), "image/class/label"
(int64), "values" (3 floats) and "ids" (2 int64s). tf_examples.json has what TensorFlow reads back:
the values, and each image decoded by tf.io.decode_image (JPEG with dct_method INTEGER_ACCURATE,
the method dtrain uses)."""
import json
import os
import sys

import numpy as np
import tensorflow as tf

out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(__file__)
expected = {"tf_version": tf.__version__, "files": []}
rng = np.random.default_rng(7)
for f, count in enumerate([5, 3]):
    path = os.path.join(out, f"tf_examples_{f}.tfrecord")
    recs = []
    with tf.io.TFRecordWriter(path) as w:
        for r in range(count):
            img = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
            enc = (tf.io.encode_jpeg(img, quality=95) if f == 0 else tf.io.encode_png(img)).numpy()
            label = 10 * f + r
            values = [float(r) + 0.25, -1.5 * r, 1e-3 * (f + 1)]
            ids = [2**40 + r, -r]
            ex = tf.train.Example(features=tf.train.Features(feature={
                "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[enc])),
                "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                "values": tf.train.Feature(float_list=tf.train.FloatList(value=values)),
                "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=ids)),
            }))
            w.write(ex.SerializeToString())
            if f == 0:
                decoded = tf.io.decode_jpeg(enc, channels=3, dct_method="INTEGER_ACCURATE")
            else:
                decoded = tf.io.decode_png(enc, channels=3)
            recs.append({"label": label,
                         "values": [float(v) for v in np.float32(values)],
                         "ids": ids,
                         "pixels": decoded.numpy().reshape(-1).tolist()})
    expected["files"].append({"name": os.path.basename(path), "records": recs})
# What tf.data reads: interleave(cycle_length=2, block_length=2) over the two files, labels in order.
ds = tf.data.Dataset.from_tensor_slices(
    [os.path.join(out, f"tf_examples_{f}.tfrecord") for f in range(2)])
ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=2, block_length=2, deterministic=True)
spec = {"image/class/label": tf.io.FixedLenFeature([], tf.int64)}
expected["interleave_2_2_labels"] = [
    int(tf.io.parse_single_example(r, spec)["image/class/label"]) for r in ds]
with open(os.path.join(out, "tf_examples.json"), "w") as fh:
    json.dump(expected, fh)
print("wrote", out, expected["interleave_2_2_labels"])
