// Trains a model (the reference CNN by default) on Fashion-MNIST under the strategy picked by
// --strategy. The program is examples/common/image_classifier.cc.
//
//   ./fashion_mnist --strategy=one_device --epochs=5
//   ./fashion_mnist --strategy=one_device --devices=cpu --threads=1 --steps=300 --json
//   dtrain-run -np 3 --max-restarts 2 -- ./fashion_mnist --strategy=multi_worker_mirrored
//       --backup-dir /tmp/backup --checkpoint-dir /tmp/ckpt --optimizer "sgd momentum=0.9"
//       --lr-schedule "cosine decay_steps=4000" --warmup-epochs 1 --scale-lr
#include "common/image_classifier.h"

int main(int argc, char** argv) {
  dtrain::examples::ImageClassifierExample e;
  e.title = "Train the reference CNN (or --model) on Fashion-MNIST with dtrain";
  return dtrain::examples::image_classifier_main(argc, argv, e);
}
