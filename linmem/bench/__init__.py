"""Benchmarks (``python -m linmem.bench.<name>``); ``environment`` names what a run measured on."""

from __future__ import annotations

import platform

import torch


def environment(device: torch.device | str) -> dict[str, str | None]:
    """``device``, ``gpu`` (the CUDA device's name, None off CUDA), ``torch``, ``triton`` and ``fla`` versions (None
    when not installed), ``cuda``, ``python``: the lines a benchmark report carries."""
    device = torch.device(device)
    versions: dict[str, str | None] = {}
    for package in ("triton", "fla"):
        try:
            versions[package] = getattr(__import__(package), "__version__", "?")
        except ImportError:
            versions[package] = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return dict(device=str(device), gpu=gpu, torch=torch.__version__, triton=versions["triton"], fla=versions["fla"],
                cuda=torch.version.cuda, python=platform.python_version())
