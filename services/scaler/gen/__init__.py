"""Stubs generated from ``proto/externalscaler.proto`` by ``python -m services.scaler.protogen``; do not edit."""
