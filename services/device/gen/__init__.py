"""Stubs generated from ``proto/deviceplugin.proto`` and ``proto/podresources.proto`` by
``python -m services.device.protogen``; do not edit."""
