"""Stubs generated from ``proto/externalscaler.proto`` by ``python -m tools.protogen``; do not edit."""
