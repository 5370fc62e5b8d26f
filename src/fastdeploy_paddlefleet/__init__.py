"""fastdeploy-paddlefleet: serve PaddleFleet models in FastDeploy (``--model-impl paddlefleet``)."""

__version__ = "0.1.0"
