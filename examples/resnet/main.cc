// ResNet-20 (He et al. 2015, section 4.2) on Fashion-MNIST padded to 32x32, with random crops and
// flips in the input pipeline (a thread per core), under the strategy picked by --strategy: SGD
// with Nesterov momentum 0.9, weight decay, a cosine schedule. The program is
// examples/common/image_classifier.cc (the flags of examples/fashion_mnist, with these defaults).
//
//   ./resnet --strategy=mirrored --devices=cpu:2
//   dtrain-run -np 2 -- ./resnet --strategy=multi_worker_mirrored --backup-dir /tmp/resnet-backup
#include "common/image_classifier.h"

int main(int argc, char** argv) {
  dtrain::examples::ImageClassifierExample e;
  e.title = "Train ResNet-20 on Fashion-MNIST (32x32, augmented) with dtrain";
  e.model = "resnet20";
  e.epochs = 15;
  e.batch_size = 128;
  e.learning_rate = 0.1f;
  e.optimizer = "sgd momentum=0.9 nesterov=1 weight_decay=0.0005";
  e.lr_schedule = "cosine decay_steps=7035";  // 15 epochs of 469 steps
  e.augment = true;
  return dtrain::examples::image_classifier_main(argc, argv, e);
}
