"""Generate and check the committed Python stubs of a gRPC contract in ``proto/`` (KEDA's external scaler, the
kubelet device plugin). Generated code is never edited by hand: ``generate`` runs protoc (grpcio-tools) and makes
one deterministic change, rewriting grpc's top-level ``import X_pb2`` into a package-relative import so the stubs
live inside the service's ``gen`` package; ``drift`` regenerates into a temporary folder and names what differs.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"


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
                if not (self.gen_dir / path.name).is_file()
                or (self.gen_dir / path.name).read_bytes() != path.read_bytes()
            ]

    def main(self, argv: list[str] | None = None) -> int:
        parser = argparse.ArgumentParser(prog=self.command, description=f"stubs of proto/{self.name}.proto")
        parser.add_argument("--check", action="store_true", help="exit 1 when the committed stubs are out of date")
        args = parser.parse_args(argv)
        if args.check:
            stale = self.drift()
            if stale:
                print(f"stale generated stubs in {self.gen_dir}: {', '.join(stale)}; run: {self.command}")
                return 1
            print(f"{self.gen_dir}: up to date with proto/{self.name}.proto")
            return 0
        for path in self.generate(self.gen_dir):
            print(f"wrote {path}")
        return 0
