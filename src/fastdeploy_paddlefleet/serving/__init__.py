"""Everything that knows FastDeploy, and the only room that imports it (lazily).

Entry points (``entry_points``), registration and routing (``registration``), the model class
``PaddleFleetForCausalLM`` (``model``, built by ``build``, weights in ``weights``), ForwardMeta
translation (``forward_meta``), FastDeploy's cache shape and per-layer views (``cache_views``),
load-time checks (``checks``), the v0 pretrained shim (``pretrained``), parallel groups
(``parallel``) and the model-directory writer (``modeldir``).

Importing this package imports nothing heavy; each module imports paddle or FastDeploy itself.
"""
