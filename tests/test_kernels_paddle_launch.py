"""Triton on paddle tensors the FastDeploy way: torch optional, Paddle's stream.

What runs here on CPU: the framework layer (``kernels/_framework.py``) allocating and converting
paddle tensors, the kernel modules importing without torch (a child process with ``torch``
blocked), and the Triton backend's routing (paddle tensors reach the launch untouched, Triton's
torch proxy enabled, when torch is absent). The kernels themselves cannot run on paddle tensors
here: Triton's CPU interpreter copies arguments through torch storages, and Paddle on this
machine has no CUDA. On a GPU with paddle they run through FastDeploy's
``paddle.enable_compat(scope={"triton"})``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

paddle = pytest.importorskip("paddle")


def _child(code: str) -> subprocess.CompletedProcess:
    prelude = "import sys\nsys.modules['torch'] = None  # torch is not installed\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_kernel_modules_and_framework_layer_work_without_torch():
    proc = _child(
        """
        import paddle
        from fastdeploy_paddlefleet.kernels import _framework as fw
        from fastdeploy_paddlefleet.kernels import cache_write, paged_attention, split_kv_reduce  # noqa: F401
        from fastdeploy_paddlefleet.kernels import hopper_prefill
        assert hopper_prefill.torch is None
        assert fw.torch is None
        q = paddle.zeros([3, 4, 8], dtype="float16")
        out = fw.empty((3, 4, 8), q.dtype, q)
        mid = fw.empty((2, 4, 5), "float32", q)
        sinks = fw.to_float32(paddle.ones([4], dtype="float16"), q)
        assert isinstance(out, paddle.Tensor) and list(out.shape) == [3, 4, 8] and out.dtype == q.dtype
        assert str(mid.dtype).endswith("float32") and str(sinks.dtype).endswith("float32")
        assert fw.num_sms(q.device) == 8
        with fw.paddle_stream(q.device):  # off the GPU: nothing to switch
            pass
        print("OK")
        """
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_backend_hands_paddle_tensors_to_the_kernels_without_torch(monkeypatch):
    """Without torch the backend neither converts nor copies: the kernels get the caller's paddle
    tensors (the cache views included) and Triton gets Paddle's torch proxy."""
    from fastdeploy_paddlefleet.backends import triton as triton_backend
    from fastdeploy_paddlefleet.kernels import _framework as fw
    from fastdeploy_paddlefleet.kernels import cache_write, paged_attention
    from fastdeploy_paddlefleet.plan.layer import LayerAttention
    from fastdeploy_paddlefleet.runner.batch import build_meta

    calls = {}
    monkeypatch.setattr(fw, "torch", None)
    monkeypatch.setattr(fw, "_COMPAT_DONE", False)
    monkeypatch.setattr(paddle, "enable_compat", lambda **kw: calls.setdefault("compat", kw))

    def write(self, k, v, step, *, stream=None):
        calls["write"] = (self.key_cache, self.value_cache, step.cu, step.table)

    def attend(self, q, step, *, out=None, flat=False, num_splits=None, stream=None):
        calls["args"] = (q, self.key_cache, self.value_cache, step.cu, step.table)
        calls["errors"] = step.errors
        assert flat  # the backend's [T, Hq * Dv] output, allocated by the plan
        return paddle.zeros([q.shape[0], layer.num_q_heads * layer.v_head_dim])

    monkeypatch.setattr(cache_write.CacheWritePlan, "run_step", write)
    monkeypatch.setattr(paged_attention.AttentionPlan, "run_step", attend)
    layer = LayerAttention(
        index=0, kind="full", num_q_heads=4, num_kv_heads=2, qk_head_dim=8, v_head_dim=4, softmax_scale=0.3
    )
    meta = build_meta([0], [3], [[0]], 4)
    wide, wide_v = paddle.zeros([2, 3, 4, 8]), paddle.zeros([2, 3, 4, 8])  # K and V: distinct tensors
    cache = (wide[:, :2], wide_v[:, :2, :, :4])
    q = paddle.zeros([3, 4, 8])
    backend = triton_backend.TritonBackend()
    out = backend.forward(q, paddle.zeros([3, 2, 8]), paddle.zeros([3, 2, 4]), layer, meta, cache)
    assert list(out.shape) == [3, 16]
    assert calls["compat"] == {"scope": {"triton"}}
    got_q, got_kc, got_vc, cu, table = calls["args"]
    assert got_q is q and got_kc is cache[0] and got_vc is cache[1]  # no conversion, no copy
    assert got_kc.data_ptr() == wide.data_ptr() and str(cu.dtype).endswith("int32")
    assert calls["write"][0] is cache[0] and calls["write"][2] is cu  # the step's int32 metadata, shared
    # the device error flag (kernels/errors.py) is a paddle int32 [8] tensor, cleared
    flag = calls["errors"]
    assert isinstance(flag, paddle.Tensor) and str(flag.dtype).endswith("int32")
    assert flag.numpy().tolist() == [0] * 8
