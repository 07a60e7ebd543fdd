"""tf.data's ImageNet-style training input pipeline over a folder of JPEGs (DIR/<class>/*.jpg), timed
for `dtrain-bench input`: list_files, decode_and_crop_jpeg with a sample_distorted_bounding_box crop
(area 0.08-1, aspect 3/4-4/3: RandomResizedCrop, as TF's official ResNet preprocessing does it),
resize to 224x224, random flip, ImageNet normalisation, batch, prefetch; map with
num_parallel_calls=AUTOTUNE (tf.data picks its threads for the cores taskset gives it).
Prints one JSON line: images_per_sec (after --warmup batches), peak_rss_mb."""
import argparse, json, os, resource, time

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--warmup", type=int, default=5)
a = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf

classes = sorted(d for d in os.listdir(a.dir) if os.path.isdir(os.path.join(a.dir, d)))
files, labels = [], []
for i, c in enumerate(classes):
    for f in sorted(os.listdir(os.path.join(a.dir, c))):
        files.append(os.path.join(a.dir, c, f))
        labels.append(i)
MEAN = tf.constant([0.485, 0.456, 0.406]) * 255
STD = tf.constant([0.229, 0.224, 0.225]) * 255


def load(path, label):
    data = tf.io.read_file(path)
    shape = tf.io.extract_jpeg_shape(data)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0),
        max_attempts=10, use_image_if_no_bounding_boxes=True)
    y, x, _ = tf.unstack(begin)
    h, w, _ = tf.unstack(size)
    img = tf.image.decode_and_crop_jpeg(data, tf.stack([y, x, h, w]), channels=3)
    img = tf.image.resize(img, [224, 224])
    img = tf.image.random_flip_left_right(img)
    return (img - MEAN) / STD, label


ds = tf.data.Dataset.from_tensor_slices((files, labels)).shuffle(len(files), seed=1)
ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE).batch(a.batch_size).prefetch(tf.data.AUTOTUNE)
# tf.data sizes its own thread pool (AUTOTUNE) to the cores it may run on (taskset); --threads is
# only recorded.
ds = ds.repeat(a.epochs)
n, start, seen = 0, None, 0
for images, _ in ds:
    seen += 1
    if seen == a.warmup:
        start = time.perf_counter()
    elif seen > a.warmup:
        n += int(images.shape[0])
secs = time.perf_counter() - start
print(json.dumps({"system": "tf", "images_per_sec": n / secs, "images": n,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
