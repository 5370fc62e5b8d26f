"""Drives a patched model the way FastDeploy's worker does (packed tokens,
per-request lengths, block tables), for ``verify`` and benchmarks.

``runner.batch`` builds the per-step batch metadata and KV caches; it imports
paddle lazily, so importing this package stays cheap.
"""
