"""The plumbing every service shares: settings, the NATS bus and its durable consumer loop, Redis config sync,
telemetry, the service runner and its HTTP server.

``bus``, ``consumer`` and ``configsync`` are the only modules here that import a transport (nats, redis); ``http``
serves HTTP with aiohttp's server.
"""
