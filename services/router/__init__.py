"""The router: the endpoint picker of the Kubernetes inference gateway, sending each session to the pod holding its KV."""
