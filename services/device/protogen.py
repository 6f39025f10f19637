"""Generate the Python stubs of the kubelet device plugin API (v1beta1) from ``proto/deviceplugin.proto``.

``python -m services.device.protogen`` writes ``services/device/gen/``; ``--check`` regenerates into a temporary
folder and exits 1 when the committed stubs differ (a test runs the same comparison). The only change to protoc's
output is deterministic: grpc's stub imports its messages as a top-level module (``import deviceplugin_pb2``),
which is rewritten to a package-relative import so the stubs live inside ``services.device.gen``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PROTO = PROTO_DIR / "deviceplugin.proto"
GEN_DIR = Path(__file__).resolve().parent / "gen"
GENERATED = ("deviceplugin_pb2.py", "deviceplugin_pb2.pyi", "deviceplugin_pb2_grpc.py")
_ABSOLUTE = "import deviceplugin_pb2 as deviceplugin__pb2"
_RELATIVE = "from . import deviceplugin_pb2 as deviceplugin__pb2"


class ProtocFailed(RuntimeError):
    pass


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) into ``out``; returns the files written."""
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
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise ProtocFailed(f"protoc failed on {PROTO}")
    stub = out / "deviceplugin_pb2_grpc.py"
    text = stub.read_text()
    if _ABSOLUTE not in text:
        raise ProtocFailed(f"{stub.name}: expected {_ABSOLUTE!r} from grpc_tools; its output changed")
    stub.write_text(text.replace(_ABSOLUTE, _RELATIVE))
    return [out / name for name in GENERATED]


def drift(committed: Path = GEN_DIR) -> list[str]:
    """Names of the generated files that differ from (or are missing in) ``committed``."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [
            path.name
            for path in fresh
            if not (committed / path.name).is_file() or (committed / path.name).read_bytes() != path.read_bytes()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.device.protogen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed stubs are out of date")
    args = parser.parse_args(argv)
    if args.check:
        stale = drift()
        if stale:
            print(f"stale generated stubs in {GEN_DIR}: {', '.join(stale)}; run: python -m services.device.protogen")
            return 1
        print(f"{GEN_DIR}: up to date with {PROTO.relative_to(ROOT)}")
        return 0
    for path in generate(GEN_DIR):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
