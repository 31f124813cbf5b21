"""Generate the Python stubs from protos/: the services' (services/common/pb) and the client
package's (clients/python/flatwire_client/pb), the same files in both.

    python scripts/gen_protos.py          # regenerate in place
    python scripts/gen_protos.py --check  # fail if the committed stubs differ

protoc writes absolute imports (`from flatwire.v1 import arrays_pb2`); they are
rewritten to relative ones so the stubs live inside each package.
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE = "flatwire/v1"
OUTS = (ROOT / "services" / "common" / "pb", ROOT / "clients" / "python" / "flatwire_client" / "pb")
ABSOLUTE_IMPORT = re.compile(r"^from flatwire\.v1 import (\w+_pb2)", re.MULTILINE)


def generate(out_dir: Path) -> None:
    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / PACKAGE).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={raw}", f"--pyi_out={raw}",
                f"--grpc_python_out={raw}", *sources]
        if protoc.main(args) != 0:
            sys.exit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for generated in sorted((Path(raw) / PACKAGE).iterdir()):
            text = ABSOLUTE_IMPORT.sub(r"from . import \1", generated.read_text())
            (out_dir / generated.name).write_text(text)
    (out_dir / "__init__.py").write_text('"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    if not parser.parse_args().check:
        for out in OUTS:
            generate(out)
        return
    with tempfile.TemporaryDirectory() as fresh:
        generate(Path(fresh))
        stale = [str(out.relative_to(ROOT) / f.name) for out in OUTS for f in sorted(Path(fresh).iterdir())
                 if not (out / f.name).exists() or (out / f.name).read_text() != f.read_text()]
        extra = [str(out.relative_to(ROOT) / name) for out in OUTS for name in sorted(
            {f.name for f in out.iterdir() if f.is_file()} - {f.name for f in Path(fresh).iterdir()})]
    if stale or extra:
        sys.exit(f"stubs out of date: {stale + extra}; run python scripts/gen_protos.py")
    print("stubs match protos/")


if __name__ == "__main__":
    main()
