"""The router: the inference gateway's endpoint picker, sending each session to the pod that holds its KV cache."""
