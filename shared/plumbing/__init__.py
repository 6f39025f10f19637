"""The plumbing every service shares: settings, the NATS bus, Redis config sync, telemetry and the service runner.

``bus`` and ``configsync`` are the only modules here that import a transport (nats, redis).
"""
