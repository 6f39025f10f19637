"""Stubs generated from ``proto/deviceplugin.proto`` and ``proto/podresources.proto`` by
``python -m tools.protogen``; do not edit."""
