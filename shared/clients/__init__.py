"""Domain clients: what a caller (the CLI, the driver's coordinator, the MIG controller) asks of the mesh, written
once. ``drains``: a drain as its caller sees it (name, check, ask, learn the verdict); ``evictions``: evicting a
node's pods with the PodDisruptionBudget back-off; ``rollouts``: a model rollout's stored state. They sit above the
transport (``shared.plumbing``) and below everything that calls them; no service imports them for its own work.
"""
