"""The plumbing every service shares: settings, the NATS bus and its durable consumer loop, Redis config sync,
telemetry and the service runner.

``bus``, ``consumer`` and ``configsync`` are the only modules here that import a transport (nats, redis).
"""
