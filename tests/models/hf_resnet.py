"""A Hugging Face ResNet with BatchNorm, as a vision user brings one: ``transformers``'
``ResNetForImageClassification`` (a tiny config: 8 and 16 channels, one basic block per stage, 7 BatchNorm2d),
pixel values and labels in, the model's own loss out. The data: 512 synthetic 16x16 RGB images of 4 classes,
each class a brighter quadrant.
"""
import numpy as np
import torch

SAMPLES, CLASSES, SIDE = 512, 4, 16


def model(cfg):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(cfg.seed)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", num_labels=CLASSES)
    return ResNetForImageClassification(config)


def forward(pixel_values, labels, net):
    out = net(pixel_values=pixel_values, labels=labels)
    return {"loss": out.loss, "accuracy": (out.logits.argmax(-1) == labels).float().mean()}


def data(cfg):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, CLASSES, SAMPLES)
    images = rng.standard_normal((SAMPLES, 3, SIDE, SIDE)).astype(np.float32) * 0.5
    half = SIDE // 2
    for i, c in enumerate(labels):
        r, q = divmod(int(c), 2)
        images[i, :, r * half:(r + 1) * half, q * half:(q + 1) * half] += 1.0
    return images, labels.astype(np.int64)
