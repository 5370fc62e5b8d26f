"""Window recycling inside FastDeploy's scheduler (engine side) and the protocol the worker reads.

``protocol``: lanes, groups and per-task page deltas (stdlib only). ``scheduler``: the hook that
routes ``ResourceManagerV1``'s block calls to the head-wise manager (imports FastDeploy lazily).
"""
