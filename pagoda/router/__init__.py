"""`pagoda router`: a reverse proxy in front of N pagoda replicas (docs/distributed.md, "The router").

    settings.py   RouterSettings: the replicas, the policy, the bounds (validated once)
    policy.py     the policy seam: `choose(replicas, request) -> index`, and core's policies behind it
    replicas.py   each replica's client, health and requests in flight; admission (the bounded queues)
    routes.py     what the router knows of each path the replicas serve: error shape, stream framing, guard
    proxy.py      the pass-through: bytes in, bytes out; a client that leaves closes the upstream request
    metrics.py    /metrics (pagoda_router_*)
    app.py        the Litestar app: /health, /metrics, everything else proxied
"""
