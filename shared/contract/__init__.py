"""The contract other systems rely on: event Structs, subject builders and the generated schemas.

This subpackage imports no transport: it is the same on the bus, in Redis and in the JSON Schema files.
"""
