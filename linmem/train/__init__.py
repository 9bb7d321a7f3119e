"""Training: YAML configs, the loop (AdamW, cosine schedule, accumulation, bf16 autocast), atomic checkpoints that
resume bit for bit, and DDP / FSDP2 under ``torchrun``.

The names below load with their module on first use (``linmem.io.lazy``), so that importing the package's command
modules (``linmem train --help``) does not import torch and transformers."""

from linmem.io.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "linmem.train.config": ("DataSection", "OptimSection", "TrainConfig", "TrainSection", "load_config",
                            "parse_config"),
    "linmem.train.schedule": ("cosine_lr",),
    "linmem.train.trainer": ("train",),
})
