"""Device service: GPU inventory and health, the kubelet device plugin, CDI specs and the MIG controller."""
