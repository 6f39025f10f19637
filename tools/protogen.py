"""``python -m tools.protogen [--check]``: generate (or check) the committed Python stubs of the gRPC contracts in
``proto/``: KEDA's external scaler (``services/scaler/gen/``), and the kubelet's device plugin API (v1beta1, which
the device service serves), PodResources API (v1, which it asks which pods hold which GPUs), DRA plugin service
(v1 and v1beta1, which its DRA driver serves) and plugin registration service, all in ``services/device/gen/``.
Generated code is never edited by hand: ``generate`` runs protoc (grpcio-tools) and makes one deterministic change,
rewriting grpc's top-level ``import X_pb2`` into a package-relative import so the stubs live inside the service's
``gen`` package; ``drift`` regenerates into a temporary folder and names what differs, apart from the line naming
the grpcio-tools release that generated a file (``GRPC_GENERATED_VERSION``): a patch release of the tools on the
package index changes it and nothing else, so it says nothing of the contract.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
COMMAND = "python -m tools.protogen"


class ProtocFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class ProtoStubs:
    """``proto/<name>.proto`` compiled into ``gen_dir``; ``command`` is how a person regenerates them."""

    name: str
    gen_dir: Path
    command: str

    @property
    def proto(self) -> Path:
        return PROTO_DIR / f"{self.name}.proto"

    @property
    def files(self) -> tuple[str, ...]:
        return (f"{self.name}_pb2.py", f"{self.name}_pb2.pyi", f"{self.name}_pb2_grpc.py")

    def generate(self, out: Path) -> list[Path]:
        """Run protoc into ``out``; returns the files written."""
        from grpc_tools import protoc

        out.mkdir(parents=True, exist_ok=True)
        well_known = str(resources.files("grpc_tools") / "_proto")
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(self.proto),
        ]
        if protoc.main(args) != 0:
            raise ProtocFailed(f"protoc failed on {self.proto}")
        stub = out / f"{self.name}_pb2_grpc.py"
        absolute = f"import {self.name}_pb2 as {self.name.replace('_', '__')}__pb2"
        text = stub.read_text()
        if absolute not in text:
            raise ProtocFailed(f"{stub.name}: expected {absolute!r} from grpc_tools; its output changed")
        stub.write_text(text.replace(absolute, f"from . {absolute}"))
        return [out / name for name in self.files]

    def drift(self) -> list[str]:
        """Names of the generated files that differ from (or are missing in) the committed ``gen_dir``."""
        with tempfile.TemporaryDirectory() as tmp:
            return [
                path.name
                for path in self.generate(Path(tmp))
                if not (self.gen_dir / path.name).is_file() or _contract(self.gen_dir / path.name) != _contract(path)
            ]


_TOOLS_VERSION = re.compile(rb"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE)


def _contract(path: Path) -> bytes:
    """A generated file without the grpcio-tools release that wrote it."""
    return _TOOLS_VERSION.sub(b"GRPC_GENERATED_VERSION = ''", path.read_bytes())


EXTERNAL_SCALER = ProtoStubs("externalscaler", ROOT / "services" / "scaler" / "gen", COMMAND)
DEVICE_PLUGIN = ProtoStubs("deviceplugin", ROOT / "services" / "device" / "gen", COMMAND)
POD_RESOURCES = ProtoStubs("podresources", ROOT / "services" / "device" / "gen", COMMAND)
DRA_V1 = ProtoStubs("dra_v1", ROOT / "services" / "device" / "gen", COMMAND)
DRA_V1BETA1 = ProtoStubs("dra_v1beta1", ROOT / "services" / "device" / "gen", COMMAND)
PLUGIN_REGISTRATION = ProtoStubs("pluginregistration", ROOT / "services" / "device" / "gen", COMMAND)
STUBS = (EXTERNAL_SCALER, DEVICE_PLUGIN, POD_RESOURCES, DRA_V1, DRA_V1BETA1, PLUGIN_REGISTRATION)


def drift() -> list[str]:
    """Every generated file, of every contract, that differs from (or is missing in) its committed folder."""
    return [name for stubs in STUBS for name in stubs.drift()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="stubs of the gRPC contracts in proto/")
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed stubs are out of date")
    args = parser.parse_args(argv)
    status = 0
    for stubs in STUBS:
        if args.check:
            stale = stubs.drift()
            if stale:
                print(f"stale generated stubs in {stubs.gen_dir}: {', '.join(stale)}; run: {COMMAND}")
                status = 1
            else:
                print(f"{stubs.gen_dir}: up to date with proto/{stubs.name}.proto")
            continue
        for path in stubs.generate(stubs.gen_dir):
            print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
