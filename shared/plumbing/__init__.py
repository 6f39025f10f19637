"""The transport every service shares, and nothing else: settings, the NATS bus and its durable consumer loop,
retries, errors, telemetry, logs, the HTTP server and Redis config sync.

``bus``, ``consumer`` and ``configsync`` are the only modules here that import a transport (nats, redis); ``http``
serves HTTP with aiohttp's server. What runs a service (the runner, hollow nodes, development servers) is in
``shared.host``; what asks the mesh for something on a caller's behalf (drains, evictions, rollouts) is in
``shared.clients``.
"""
