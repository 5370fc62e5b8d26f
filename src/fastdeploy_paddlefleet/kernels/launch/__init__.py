"""How a compiled Triton kernel gets launched: the lanes, when each one is taken, how to switch it off.

Every kernel of :mod:`fastdeploy_paddlefleet.kernels` can be launched four ways, each one cheaper in
host time than the one before it and each one falling back to the one before it when it cannot
reproduce that launch exactly (host figures per launch on an H200's host: ``benchmarks/NOTES.md``).

1. **Triton's path**, ``kernel[grid](*args, **constexprs)``: Triton binds every argument, derives its
   specialisation, looks the compiled kernel up (compiling it the first time) and launches it. Always
   taken for a plan's first call with a given key, under ``TRITON_INTERPRET=1``, on a CPU, while a
   Triton launch hook (a profiler) is set when the plan is built, for a call whose pointers are not
   all 16-byte aligned, and for every call when ``FDFLEET_DIRECT_LAUNCH=0``.
2. **Direct launch** (:mod:`.direct`, :class:`~.direct.KernelCache`): after that first call the plan
   keeps the compiled kernel under a key of everything that can change it, and later calls with the
   same key launch the kept kernel without Triton's binding. On by default; off with
   ``FDFLEET_DIRECT_LAUNCH=0`` (or :data:`.direct.DIRECT_LAUNCH` = ``False``, as
   ``benchmarks/attention.py --no-direct-launch`` sets it). Kept kernels get pointers as addresses
   (:data:`.direct.ADDRESS_ARGS`; ``benchmarks/attention.py --tensor-args`` passes the tensors, an
   A/B of the per-pointer cost, which also keeps lane 3 off). A kept kernel the plugin's own launcher
   cannot reproduce goes through the compiled kernel's Triton launcher
   (:class:`~.direct.TritonHit`).
3. **Our own launcher** (:mod:`.own_launcher`, :class:`~.own_launcher.OwnLauncher`): a kept kernel
   launched with one ``struct`` pack into a fixed argument buffer and one ``cuLaunchKernel``, TMA
   descriptors encoded once. Taken for a direct launch by addresses when it reproduces Triton's launch
   exactly; refused (logged, lane 2's Triton launcher serves) for clusters, cooperative grids, PDL,
   scratch memory, unknown argument types, descriptors without TMA metadata, no libcuda. On by
   default; off with ``FDFLEET_OWN_LAUNCHER=0`` (or :data:`.direct.OWN_LAUNCHER` = ``False``).
4. **The C entry point** (:mod:`.c_entry`): lane 3 calls ``cuLaunchKernel`` (and packs the values)
   from a small C extension built once per machine with Triton's own compiler helper, instead of
   through ctypes. Taken whenever lane 3 is and the module builds; where it cannot be built (no
   compiler or Python headers, an older Triton) lane 3 calls libcuda through ctypes (logged once).
   It has no switch of its own: ``FDFLEET_OWN_LAUNCHER=0`` turns it off with lane 3.

Above the kernels, two callers skip even the plans' per-call Python once every kernel a call needs is
kept (both launch through lanes 2-4, so the switches above turn them off too):

* the one-shot wrappers (``paged_attention``, ``write_kv_cache``) keep their plans in a
  :class:`~.direct.PlanMemo` and, for a call like an earlier one, launch the kept kernels from the
  step's values at once (``launch_kept``);
* the Triton backend's kept lane (``backends/triton.py``, ``KEPT_LANE``) does the same per layer, on
  torch tensors or on paddle tensors by their addresses (the *paddle lane*: no DLPack views).

The switches are read when a plan is built (a memoised plan's key holds them: a changed switch builds
anew); ``envs.py`` parses them strictly. Nothing is imported here: each module loads when it is used.
"""

__all__ = ["c_entry", "direct", "own_launcher"]
