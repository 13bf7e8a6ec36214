"""Regenerate the Python code of protos/ (committed; tests/test_protos.py fails when it is stale).

    python protos/generate.py [OUT_DIR]   # default: the repository root, in place
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    sources = sorted((ROOT / "protos").rglob("*.proto"))
    relative = [str(s.relative_to(ROOT)) for s in sources]
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + relative) != 0:
        raise RuntimeError("protoc failed")
    return sorted(p for p in (out_dir / "protos").rglob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
