"""What the launch wrappers need from a tensor framework, for torch or paddle tensors; torch optional.

A Triton kernel reads any argument with ``data_ptr()``, ``stride()`` and ``dtype``; paddle tensors
have them (and ``dim()``, ``element_size()``, ``is_cuda``, ``device.type``), so the wrappers run on
either framework once allocation, dtype objects and device queries go through here.

Launching on paddle tensors follows FastDeploy's convention
(``fastdeploy/model_executor/ops/triton_ops/triton_utils.py``, ``fastdeploy/__init__.py``):

* torch not installed: Triton's own modules get Paddle's torch proxy,
  ``paddle.enable_compat(scope={"triton"})`` (FastDeploy does this when it is imported;
  :func:`paddle_launch` does it if nobody has), so Triton's launcher asks *Paddle* for the current
  device and stream;
* torch installed: the backend hands the kernels torch views of the paddle tensors (DLPack,
  zero-copy) and runs them inside :func:`paddle_stream`, i.e. on Paddle's current CUDA stream as
  a torch ``ExternalStream``; a CUDA graph Paddle captures therefore records the launches. Kernels
  compiled and kept by those calls then launch by addresses read from the paddle tensors, on the
  stream :func:`paddle_stream_reader` reads, into outputs :func:`paddle_empty` allocates (the
  backend's paddle lane: no views).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

logger = logging.getLogger(__name__)

try:
    import torch
except ImportError:  # torch-free deployment (FastDeploy's): kernels run on paddle tensors
    torch = None  # type: ignore[assignment]


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (a subclass too)."""
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(x: Any) -> str:
    """``float32`` / ``bfloat16`` / ... of a torch or paddle tensor."""
    return str(x.dtype).rsplit(".", 1)[-1]


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``): block shapes Triton's ``tl.arange`` takes."""
    return 1 << max(0, (int(x) - 1).bit_length())


def empty(shape: Sequence[int], dtype: Any, like: Any) -> Any:
    """An uninitialised tensor of ``shape`` on ``like``'s device and framework; ``dtype`` is a dtype
    object of that framework or a name (``"float32"``)."""
    shape = [int(s) for s in shape]
    if is_torch(like):
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return torch.empty(shape, dtype=dtype, device=like.device)
    import paddle

    name = dtype if isinstance(dtype, str) else str(dtype).rsplit(".", 1)[-1]
    return paddle.empty(shape, dtype=name, device=like.device)


def to_float32(x: Any, like: Any) -> Any:
    """``x`` as a contiguous float32 tensor on ``like``'s device (a no-op when it already is)."""
    if is_torch(x):
        return x.to(device=like.device, dtype=torch.float32).contiguous()
    return x.astype("float32").contiguous()


@functools.lru_cache(maxsize=8)
def _sms(kind: str, index: int) -> int:
    if kind == "torch":
        return torch.cuda.get_device_properties(index).multi_processor_count
    import paddle

    return paddle.device.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: Any) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (torch or paddle); 8 off the GPU."""
    if getattr(device, "type", None) != "cuda":
        return 8
    index = getattr(device, "index", None)
    kind = "torch" if type(device).__module__.startswith("torch") else "paddle"
    return _sms(kind, 0 if index is None else int(index))


def _paddle_stream_handle() -> int | None:
    """Paddle's current CUDA stream as a raw ``cudaStream_t`` (``None`` off the GPU)."""
    import paddle

    if not paddle.device.is_compiled_with_cuda():
        return None
    stream = paddle.device.current_stream()
    for holder in (stream, getattr(stream, "stream_base", None)):
        for attr in ("cuda_stream", "raw_stream"):
            handle = getattr(holder, attr, None)
            if handle is not None:
                return int(handle)
    raise RuntimeError(f"cannot read the raw CUDA stream of paddle's current stream {stream!r}")


def paddle_stream_reader(index: int) -> Callable[[], int]:
    """A function returning Paddle's current CUDA stream on device ``index`` as a raw ``cudaStream_t``:
    the core call ``paddle.device.current_stream`` ends in, without its Python ``Stream`` wrapper (~1 us
    instead of several; the backend's paddle lane reads it once per layer)."""
    from paddle.base import core

    get = core._get_current_stream
    return lambda: get(index).cuda_stream


def paddle_empty() -> Callable[[Sequence[int], Any, Any], Any]:
    """Paddle's allocation without ``paddle.empty``'s argument handling: ``fn(shape, dtype, place)``
    with ``dtype`` a paddle dtype and ``place`` a paddle place (``_C_ops.empty``, ~1.7 us here against
    ~8 us; ``paddle.empty`` where a Paddle lacks it)."""
    import paddle

    try:
        from paddle import _C_ops

        return _C_ops.empty
    except (ImportError, AttributeError):
        return lambda shape, dtype, place: paddle.empty(shape, dtype=dtype, device=place)


@contextlib.contextmanager
def paddle_stream(device: Any) -> Iterator[None]:
    """Run torch launches on Paddle's current CUDA stream (a no-op off the GPU).

    Triton's launcher takes torch's current stream: making it Paddle's keeps the kernels ordered
    with Paddle's own work and inside a CUDA graph Paddle is capturing.
    """
    if torch is None or getattr(device, "type", None) != "cuda":
        yield
        return
    handle = _paddle_stream_handle()
    if handle is None or handle == torch.cuda.current_stream(device).cuda_stream:
        yield
        return
    with torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device)):
        yield


_COMPAT_DONE = False


def ensure_paddle_compat() -> None:
    """Without torch, give Triton Paddle's torch proxy (``paddle.enable_compat(scope={"triton"})``),
    as ``import fastdeploy`` does; a no-op when torch is installed or it was done."""
    global _COMPAT_DONE
    if _COMPAT_DONE or torch is not None:
        return
    import paddle

    paddle.enable_compat(scope={"triton"})
    _COMPAT_DONE = True
    logger.info("triton launches on paddle tensors through paddle.enable_compat(scope={'triton'})")


__all__ = [
    "dtype_name",
    "empty",
    "ensure_paddle_compat",
    "is_torch",
    "num_sms",
    "paddle_empty",
    "paddle_stream",
    "paddle_stream_reader",
    "to_float32",
    "torch",
]
