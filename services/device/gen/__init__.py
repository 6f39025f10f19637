"""Stubs generated from ``proto/deviceplugin.proto`` by ``python -m services.device.protogen``; do not edit."""
