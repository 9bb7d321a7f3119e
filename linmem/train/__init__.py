"""Training: YAML configs, the loop (AdamW, cosine schedule, accumulation, bf16 autocast), atomic checkpoints that
resume bit for bit, and DDP / FSDP2 under ``torchrun``."""

from linmem.train.config import DataSection, OptimSection, TrainConfig, TrainSection, load_config, parse_config
from linmem.train.schedule import cosine_lr
from linmem.train.trainer import train

__all__ = ["DataSection", "OptimSection", "TrainConfig", "TrainSection", "cosine_lr", "load_config", "parse_config",
           "train"]
