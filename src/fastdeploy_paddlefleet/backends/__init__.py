"""Attention backends: one interface (``base``), several implementations.

Implementations are imported lazily so that the core never pulls in paddle,
torch or triton: use :func:`get_backend`.
"""

from __future__ import annotations

from .base import AttentionBackend, BatchMeta

__all__ = ["AttentionBackend", "BatchMeta", "get_backend"]


def get_backend(name: str) -> AttentionBackend:
    """Return a backend instance by name: ``reference``, ``triton`` or ``auto``.

    ``auto`` picks ``triton`` when a CUDA GPU is visible, else ``reference``.
    """
    if name == "auto":
        from ._detect import cuda_available

        name = "triton" if cuda_available() else "reference"
    if name == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend()
    if name == "triton":
        from .triton import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected one of: auto, reference, triton")
