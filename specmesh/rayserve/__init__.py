"""specmesh on Ray Serve (the `ray` extra: `pip install 'specmesh[ray]'`).

Verifier and drafter replicas are Ray Serve deployments, each running the ordinary worker (its gRPC server, engine
and prefix cache) in the replica's process on whichever node Ray places it (workers.py). The coordinator deployment
is the HTTP ingress, the same OpenAI-compatible app as `coordinator serve`; it learns the live replicas' gRPC
addresses from Ray (a broadcast to the worker deployments) and keeps its own fleet logic over them: health, prefix
affinity, failover (ingress.py). Ray places, restarts and scales the replicas; verifier autoscaling is Serve's
`autoscaling_config` on the generations each replica is serving (autoscaling.py). `build_app` (app.py) is the
application, for `serve run deploy/ray/specmesh.yaml`, KubeRay's RayService, or `serve.run` from Python.

config.py (the application's arguments, checked offline), autoscaling.py and local_cluster.py (a multi-node Ray
cluster on one machine, for the smoke run) import without Ray; the rest needs it.
"""
