"""The process host: what runs services. ``runner`` starts one service (its bus, ports, config watch, HTTP and
loops); ``hollow`` runs a node-scoped service once per simulated node in one process; ``entry`` is a service's
``__main__`` (it picks one node or hollow nodes, so neither of those imports the other); ``devservers`` starts
NATS and Redis for development and tests.
"""
