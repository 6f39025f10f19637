"""The device service's Dynamic Resource Allocation driver (``resource.k8s.io/v1``), beside its device plugin.

``slices`` turns the node's inventory into the ResourceSlice the scheduler allocates from (a device per GPU and per
MIG device, named as NVIDIA's DRA driver names its attributes and capacities); ``driver`` publishes it through the
cluster port when it changes; ``claims`` writes and removes the CDI spec of a prepared claim; ``kubelet`` serves
the kubelet's DRA plugin service and plugin registration over unix sockets.
"""
