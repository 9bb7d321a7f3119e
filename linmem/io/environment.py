"""What a measurement or a training run ran on: the device, the GPU's name and the software versions, recorded beside
its numbers so that a record taken on one machine can be read beside one taken on another."""

from __future__ import annotations

import importlib.metadata
import platform

import torch


def _version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` that is installed (read from its metadata, without
    importing it: FLA's import, for one, warns on a machine without a GPU), or None when none is."""
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment(device: torch.device | str) -> dict[str, str | None]:
    """``device``, ``gpu`` (the CUDA device's name, None off CUDA), the ``torch``, ``triton``, ``fla``,
    ``transformers`` and ``linmem`` versions (None where not installed), ``cuda`` (torch's CUDA version) and
    ``python``."""
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return dict(device=str(device), gpu=gpu, torch=torch.__version__, triton=_version("triton", "pytorch-triton"),
                fla=_version("flash-linear-attention"), transformers=_version("transformers"),
                linmem=_version("linmem"), cuda=torch.version.cuda,
                python=platform.python_version())
