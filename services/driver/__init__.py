"""Driver service: the node's driver version and the cluster-wide rolling upgrade that never evicts a pod before
its KV caches are saved."""
