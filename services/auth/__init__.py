"""Auth service: the NATS auth callout. Every connection proves who it is (a service's password, a pod's
Kubernetes service-account token) and gets a user with exactly that identity's permissions."""
