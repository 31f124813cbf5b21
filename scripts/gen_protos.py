"""Generate the Python stubs from protos/ into the wire package (services/wire/flatwire_wire/pb), the one
place generated code lives: the services and the client package import it from there.

    python scripts/gen_protos.py          # regenerate in place
    python scripts/gen_protos.py --check  # fail if the committed stubs differ

protoc writes absolute imports (`from flatwire.v1 import arrays_pb2`); they are rewritten to relative
ones, and the public (flatwire/v1) and internal (flatwire/internal/v1) modules share one folder.
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "services" / "wire" / "flatwire_wire" / "pb"
ABSOLUTE_IMPORT = re.compile(r"^from flatwire\.(?:internal\.)?v1 import (\w+_pb2)", re.MULTILINE)


def generate(out_dir: Path) -> None:
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={raw}", f"--pyi_out={raw}",
                f"--grpc_python_out={raw}", *sources]
        if protoc.main(args) != 0:
            sys.exit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for generated in sorted(p for p in Path(raw).rglob("*") if p.is_file()):
            text = ABSOLUTE_IMPORT.sub(r"from . import \1", generated.read_text())
            (out_dir / generated.name).write_text(text)
    (out_dir / "__init__.py").write_text('"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    if not parser.parse_args().check:
        for stale in OUT.glob("*_pb2*"):
            stale.unlink()
        generate(OUT)
        return
    with tempfile.TemporaryDirectory() as fresh:
        generate(Path(fresh))
        stale = [f.name for f in sorted(Path(fresh).iterdir())
                 if not (OUT / f.name).exists() or (OUT / f.name).read_text() != f.read_text()]
        extra = sorted({f.name for f in OUT.iterdir() if f.is_file()} - {f.name for f in Path(fresh).iterdir()})
    if stale or extra:
        sys.exit(f"stubs in {OUT.relative_to(ROOT)} out of date: {stale + extra}; run python scripts/gen_protos.py")
    print("stubs match protos/")


if __name__ == "__main__":
    main()
