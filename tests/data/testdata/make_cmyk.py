"""Writes the CMYK JPEG data_test decodes (run once with TensorFlow 2.21 and Pillow; the files are
committed), and what TensorFlow decodes it to:

    build/peers-venv/bin/python tests/data/testdata/make_cmyk.py tests/data/testdata

cmyk.jpg: an 8x6 image of random CMYK values as Pillow writes CMYK (Adobe's inverted form, with
the Adobe marker), as Photoshop does. cmyk.json: tf.io.decode_jpeg(channels=3, dct_method
INTEGER_ACCURATE), row-major RGB bytes. TensorFlow refuses channels=1 for such a file.
cmyk_plain.jpg: the same file without its Adobe marker (APP14), which libjpeg and TensorFlow read as
plain, not inverted, CMYK; cmyk.json's "rgb_plain" is TensorFlow's decode of it."""
import json
import os
import sys

import numpy as np
import tensorflow as tf
from PIL import Image

out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(__file__)
rng = np.random.default_rng(3)
cmyk = rng.integers(0, 256, size=(6, 8, 4), dtype=np.uint8)
path = os.path.join(out, "cmyk.jpg")
Image.fromarray(cmyk, mode="CMYK").save(path, quality=95)
with open(path, "rb") as f:
    data = f.read()


def without_adobe_marker(jpeg):
    at = 2  # after SOI; every segment up to the scan is FF xx and a 2-byte length
    while jpeg[at] == 0xFF and jpeg[at + 1] != 0xDA:
        length = int.from_bytes(jpeg[at + 2:at + 4], "big")
        if jpeg[at + 1] == 0xEE:
            return jpeg[:at] + jpeg[at + 2 + length:]
        at += 2 + length
    raise ValueError("no Adobe marker")


plain = without_adobe_marker(data)
with open(os.path.join(out, "cmyk_plain.jpg"), "wb") as f:
    f.write(plain)


def decode(jpeg):
    rgb = tf.io.decode_jpeg(jpeg, channels=3, dct_method="INTEGER_ACCURATE").numpy()
    return [int(v) for v in rgb.reshape(-1)]


with open(os.path.join(out, "cmyk.json"), "w") as f:
    json.dump({"tf_version": tf.__version__, "height": 6, "width": 8, "rgb": decode(data),
               "rgb_plain": decode(plain)}, f)
