"""A recomputed block never cuts cached paths out of FastDeploy's radix tree (issue 32, the tree).

With window recycling a prefix match can be cut below FastDeploy's own (a released window unit
was evicted), and the request recomputes blocks that are nodes of the tree already. FastDeploy's
``mm_build_path`` (c1b7c083d ``prefix_cache_manager.py`` 2034) writes the new node over the old
child of the same hash, which cuts everything cached below the old node off from the root, and a
later eviction of the old node deletes the new one from its parent (``del
parent.children[hash]``). The hook keeps the old node's subtree under the new node
(``PrefixCache._graft``).

In a fresh child process per preset, FastDeploy's REAL ``ResourceManagerV1`` schedules the seeded
multi-turn chat trace of ``test_prefix_hit_rate.py`` on a pool small enough that matches are cut
(140 blocks of 64 tokens), prefix caching on, recycling on and off. After every step, checked
against FastDeploy's own tree (``radix_tree_root``, ``node_map``, ``req_leaf_map``):

* every node reachable from the root has the parent pointer of the node it hangs from;
* every node's ``shared_count`` equals the number of running requests whose path (leaf to root by
  ``parent``, as FastDeploy's release walks it) passes through it;
* every node of ``node_map`` is reachable from the root or hangs below a replaced node (renamed,
  ``ORPHAN_PREFIX``): nothing cached is cut off unseen.

The run must replace nodes at all (else it proves nothing), and still serve at least 0.95 of the
cached tokens FastDeploy alone serves on the same trace and KV bytes.
"""

from __future__ import annotations

import json

import pytest
from _fastdeploy_host import host_or_skip, run_scenario

PLUGIN_ENV = {"FD_PLUGINS": "paddlefleet"}
PRESETS = ["gpt-oss-20b", "mimo-v2-flash-like"]


@pytest.fixture(scope="module")
def host():
    pytest.importorskip("paddle", reason="FastDeploy's scheduler imports paddle")
    return host_or_skip()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    return str(write_model_dir("tiny", tmp_path_factory.mktemp("fdtiny"), dtype="float32", seed=5))


TREE = """
import json, os
import fastdeploy
from _scheduler_sim import make_config, make_manager, recycler_of
from _prefix_trace import ChatSim, make_chat_trace
from fastdeploy_paddlefleet.presets import load_preset
from fastdeploy_paddlefleet.serving.kv_recycling.prefix_cache import ORPHAN_PREFIX

d = os.path.join(WORK, PRESET)
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(load_preset(PRESET), f)
trace = make_chat_trace(3, 12, (3, 6), 2048, (64, 512), (32, 256), every=20, think=5, max_context=8000)


def check_tree(cm, step):
    root = cm.radix_tree_root
    reachable, todo = set(), [root]
    while todo:
        n = todo.pop()
        for h, c in n.children.items():
            if c.parent is not n or c.hash_value != h:
                raise AssertionError(f"step {step}: node {c.node_id} hangs from {n.node_id} under {h} "
                                     f"but its parent is {getattr(c.parent, 'node_id', None)}")
            reachable.add(c)
            todo.append(c)
    through = {}
    for rid, leaf in cm.req_leaf_map.items():
        n = leaf
        while n is not None and n is not root:
            through[n] = through.get(n, 0) + 1
            n = n.parent
    for n in list(cm.node_map.values()) + list(through):
        if n.shared_count != through.get(n, 0):
            raise AssertionError(
                f"step {step}: node {n.node_id} shared_count {n.shared_count}, {through.get(n, 0)} "
                f"running requests pass through it (req_id_set {sorted(n.req_id_set)})"
            )
    for n in cm.node_map.values():
        if n in reachable:
            continue
        m = n
        while m is not None and m is not root and not str(m.hash_value).startswith(ORPHAN_PREFIX):
            m = m.parent
        if m is None or m is root:
            raise AssertionError(f"step {step}: node {n.node_id} is cut off from the root unseen")
    return len(reachable)


runs = []
for mode in ("off", "auto"):
    os.environ["FDFLEET_KV_RECYCLE"] = mode
    cfg = make_config(TINY, max_model_len=8192, max_num_seqs=32, max_num_batched_tokens=2048,
                      block_size=64, num_blocks=BLOCKS)
    cfg.cache_config.enable_prefix_caching = True  # FastDeploy turns it off on CPU: on, as on a GPU
    rm = make_manager(cfg, d)
    rec = recycler_of(rm)
    sim = ChatSim(rm, 1, check=False)
    sim.worker.check = rec is not None
    sim.worker._check_tables = lambda step: None
    checked = [0, 0]
    plain_step = sim.step

    def step(i, aborts, plain_step=plain_step, cm=rm.cache_manager):
        out = plain_step(i, aborts)
        checked[0] += 1
        checked[1] = max(checked[1], check_tree(cm, i))
        return out

    sim.step = step
    st, chat = sim.run_chat(trace, 100000)
    runs.append(dict(mode=mode, served=chat.served, steps=st.steps, finished=st.finished,
                     preempted=st.preempted, checked_steps=checked[0], max_tree=checked[1],
                     grafts=rec.prefix.grafts if rec is not None else 0,
                     left=len(rm.requests)))
report(runs=runs, requests=trace.requests)
"""


@pytest.mark.parametrize("preset", PRESETS)
def test_recomputed_blocks_keep_the_cached_subtree(host, tiny_dir, tmp_path, preset):
    script = f"TINY = {tiny_dir!r}\nWORK = {str(tmp_path)!r}\nPRESET = {preset!r}\nBLOCKS = 140\n" + TREE
    d = run_scenario(script, host=host, env=PLUGIN_ENV, timeout=900).check().data
    runs = {r["mode"]: r for r in d["runs"]}
    print(preset, json.dumps(runs))  # -rP
    for r in runs.values():
        assert r["finished"] == d["requests"] and r["left"] == 0, r
        assert r["checked_steps"] == r["steps"] > 0, r
    assert runs["off"]["grafts"] == 0
    assert runs["auto"]["grafts"] > 0, "the trace no longer makes a recomputed block replace a node"
    assert runs["auto"]["served"] >= 0.95 * runs["off"]["served"], runs
