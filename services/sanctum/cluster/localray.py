"""A Ray cluster on this machine only, every one of its processes listening on loopback.

Ray binds its gRPC servers (GCS, raylet, object manager, core workers), its agents and its
Prometheus exporters (dashboard agent, dashboard, autoscaler) to the node's address, or to all
interfaces. On macOS and Windows that address is 127.0.0.1 and everything stays on loopback; on
Linux it is the host's outward address, unless Ray is told that this cluster is one machine:
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's own switch, read when `ray` is imported and inherited by
every process Ray starts. The dashboard stays off and so does metrics collection (the dashboard
agent's exporter); the autoscaler's and the dashboard's exporters listen on loopback. A cluster
spanning hosts is started with
`ray start` instead (deploy/README.md says what it needs); `sanctum serve` then joins it through
RAY_ADDRESS and this module is not used.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("sanctum.cluster")

ONE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# Ray starts its worker processes at niceness 15 (its `worker_niceness` setting), so the role
# processes would lose every contest for a core to the front end and Ray's own daemons (the
# verifier's forward slows down; docs/performance.md). A local cluster we start runs them at
# 0; on a cluster started elsewhere each role tries to lower its own (cluster/actors.py).
# Ray's metrics collection is off: nothing here reads it, and it is one exporter fewer.
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0, "enable_metrics_collection": False}


def init_local_ray(**kwargs) -> None:
    """`ray.init` of a new local cluster on loopback, with LOCAL_RAY_SYSTEM_CONFIG (keyword
    arguments go to ray.init)."""
    kwargs["_system_config"] = {**LOCAL_RAY_SYSTEM_CONFIG, **kwargs.get("_system_config", {})}
    os.environ.update(ONE_MACHINE_ENV)  # before `import ray`, and for the processes it starts
    already = "ray" in sys.modules
    import ray
    from ray._private import ray_constants

    if already and ray_constants.ENABLE_RAY_CLUSTER:  # imported before the variable was set
        ray_constants.ENABLE_RAY_CLUSTER = False  # what Ray would have read from it
    kwargs.setdefault("include_dashboard", False)
    ray.init(**kwargs)
    address = ray.util.get_node_ip_address()
    if address not in ("127.0.0.1", "::1"):
        log.warning("the local Ray cluster listens on %s, not only on loopback", address)
