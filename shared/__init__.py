"""Common code of the gpuwarden services: the contract, the plumbing, the ports and the KV agent.

Nothing here imports ``services``; the services import from here.
"""
