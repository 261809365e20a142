"""A ResNet-style CNN with BatchNorm on 32x32 RGB images: the shape of a CIFAR model, sized for 2 CPU cores.

    elasticflow train models/small_resnet.py launcher.workers=2 trainer.micro_batch_size=32

A 3x3 stem (16 channels), three stages of one basic residual block each (16, 32, 64 channels; the
second and third halve the resolution with a strided conv and a 1x1 projection on the shortcut), global
average pooling and a linear head: ResNet-8 in the CIFAR family, 9 BatchNorm layers, 78k parameters.
``model_args.width`` sets the stem's channels (default 16), ``model_args.blocks`` the blocks per stage
(default 1; 3 is ResNet-20).

The data is synthetic and offline (no download): ``model_args.samples`` images (default 2048) of 10
classes, each a class's smooth random pattern under a random brightness and noise, from a fixed seed
(independent of the training seed), so every process that calls data() gets the same arrays.
scripts/bench/bench_elastic.py trains it against torchrun + DDP (scripts/bench/baselines/ddp_resnet.py).

Set ``trainer.micro_batch_size``: then BatchNorm's batch statistics are those of fixed micro-batches,
whatever the number of workers (README, "BatchNorm").
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 10
SIDE = 32


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus the shortcut (a strided 1x1 conv + BN where the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks):
                layers.append(Block(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, CLASSES)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build(width: int = 16, blocks: int = 1, seed: int = 0) -> SmallResNet:
    """The network with the weights ``model(cfg)`` gives for ``seed`` (the DDP baseline builds it here too)."""
    torch.manual_seed(seed)
    return SmallResNet(width, blocks)


def model(cfg):
    args = cfg.model_args
    return build(int(args.get("width", 16)), int(args.get("blocks", 1)), int(cfg.seed))


def forward(x, y, net):
    logits = net(x)
    return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(-1) == y).float().mean()}


def images(samples: int = 2048, seed: int = 1234):
    """(x, y): x float32 (samples, 3, 32, 32), y int64 (samples,): a smooth pattern per class (random
    noise blurred by averaging 4x4 blocks, upsampled), times a random brightness, plus pixel noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.normal(0, 1, (CLASSES, 3, SIDE // 4, SIDE // 4)).astype(np.float32)
    patterns = coarse.repeat(4, axis=2).repeat(4, axis=3)
    y = rng.integers(0, CLASSES, samples)
    gain = rng.uniform(0.5, 1.5, (samples, 1, 1, 1)).astype(np.float32)
    x = patterns[y] * gain + rng.normal(0, 1.0, (samples, 3, SIDE, SIDE)).astype(np.float32)
    return x.astype(np.float32), y.astype(np.int64)


def data(cfg):
    return images(int(cfg.model_args.get("samples", 2048)))
