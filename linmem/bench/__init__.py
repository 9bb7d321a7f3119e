"""Benchmarks (``python -m linmem.bench.<name>``); ``environment`` names what a run measured on."""

from linmem.io.environment import environment

__all__ = ["environment"]
