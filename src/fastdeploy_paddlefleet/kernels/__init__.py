"""Triton kernels for paged attention on FastDeploy's KV cache, with their launch wrappers.

* :mod:`.paged_attention`: :func:`~.paged_attention.paged_attention`, one launch API for packed
  batches that mix prefill chunks (with context in the cache) and decode tokens;
* :mod:`.cache_write`: :func:`~.cache_write.write_kv_cache`, this step's K/V into the cache;
* :mod:`.split_kv_reduce`: the flash-decoding reduce step of the split-KV decode path;
* :mod:`.dense_reference`: the same math as a dense torch computation (tests, benchmarks);
* :mod:`.launch`: how a compiled kernel is launched (Triton's path, direct launches, our own launcher,
  its C entry point), when each lane is taken and how to switch it off.

Nothing is imported here: torch and triton load only when a submodule is used.
"""

__all__ = ["cache_write", "dense_reference", "launch", "paged_attention", "split_kv_reduce"]
