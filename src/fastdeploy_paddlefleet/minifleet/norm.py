"""RMSNorm, as PaddleFleet's ``layernorm_epsilon`` norm."""

from __future__ import annotations

import paddle


class RMSNorm(paddle.nn.Layer):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis."""

    def __init__(self, hidden_size: int, epsilon: float = 1e-6) -> None:
        super().__init__()
        self.epsilon = epsilon
        self.weight = self.create_parameter(
            [hidden_size], dtype="float32", default_initializer=paddle.nn.initializer.Constant(1.0)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x32 = x.astype("float32")
        y = x32 * paddle.rsqrt(x32.pow(2).mean(axis=-1, keepdim=True) + self.epsilon)
        return (y * self.weight.astype("float32")).astype(x.dtype)
