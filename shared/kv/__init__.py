"""The KV agent and its checkpoint stores: a library imported by the inference server.

The server registers its sessions' KV blocks (numpy arrays, torch CPU/CUDA tensors, CuPy arrays, anything with
the buffer protocol or DLPack); the agent saves them to a store when the checkpoint service asks, when the pod's
preStop hook runs, and periodically; a new pod restores them byte for byte. See ``shared.kv.agent``.
"""
