"""Development tools, run from a source checkout and never by a running service: the generators of what is
committed (``schemas``: proto/events/ from the contract; ``protogen``: the gRPC stubs in services/*/gen/;
``envdoc``: docs/configuration.md's table of variables) and ``gpu_check`` (``make gpu-check``: the NVML adapter on
this machine's GPUs). ``shared`` and ``services`` never import this package."""
