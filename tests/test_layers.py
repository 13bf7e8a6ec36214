"""The layers of docs/architecture.md, enforced: every import of every module of ours (at any depth of the
module, so an import inside a function counts) is one that the table below allows."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "engine", "kvtransfer", "mesh", "router", "prefill_svc", "decode_svc", "expert_svc")
SERVICES = ("router", "prefill_svc", "decode_svc", "expert_svc")
# Above the services, as their clients (they start services as processes, by module name, and call them over gRPC).
CONTROL = ("mesh.cli", "mesh.cli_admin", "mesh.supervisor", "mesh.children")
# Plain-Python leaves of the engine that the mesh's plumbing may use: failure types, core lists, the model's and
# the engine's configuration (defaults and checks), and dying with a parent process.
ENGINE_LEAVES = ("engine.errors", "engine.cpus", "engine.config", "engine.engine_config", "engine.parallel.lifetime")
# Where the serving core of the engine sits above engine.parallel, which runs the model math over ranks.
ENGINE_SERVING = ("engine.core", "engine.llm", "engine")


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer(module: str) -> str:
    if under(module, *CONTROL):
        return "control"
    if under(module, *SERVICES):
        return module.split(".")[0]
    return module.split(".")[0]


def allowed(importer: str, imported: str) -> bool:
    """Whether `importer` (a module of ours) may import `imported` (a module of ours)."""
    kind = layer(importer)
    if kind == "protos":
        return under(imported, "protos")
    if kind == "engine":
        if not under(imported, "engine"):
            return False
        if under(importer, "engine.parallel"):  # the parallel runtime is below the engine's serving core
            return imported not in ENGINE_SERVING
        if under(imported, "engine.parallel"):  # and only the serving core reaches down to it
            return importer in ENGINE_SERVING or imported == "engine.parallel.lifetime"
        return True
    if kind == "kvtransfer":
        return under(imported, "kvtransfer", "engine", "protos")
    if kind == "mesh":  # the plumbing every service shares
        return (under(imported, "mesh", "protos") and not under(imported, *CONTROL)) or \
            under(imported, *ENGINE_LEAVES)
    if kind in SERVICES:  # a service never imports another, nor the control layer
        return under(imported, kind, "engine", "kvtransfer", "mesh", "protos") and not under(imported, *CONTROL)
    if kind == "control":
        return not under(imported, *SERVICES)
    raise AssertionError(f"{importer}: no layer")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module of ours that `path` imports, resolved to its full name ("from engine import errors" names
    engine.errors when that is a module)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                is_module = (ROOT / Path(*full.split("."))).with_suffix(".py").exists() or \
                    (ROOT / Path(*full.split("."))).is_dir()
                found.add(full if is_module else base)
    return {m for m in found if under(m, *PACKAGES)}


def our_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_every_import_follows_the_layers():
    broken = [f"{module_name(p)} imports {m}" for p in our_modules() for m in sorted(imports(p))
              if not allowed(module_name(p), m)]
    assert not broken, "imports the layers forbid (docs/architecture.md):\n" + "\n".join(broken)


def test_only_the_parallel_runtime_imports_torch_distributed_and_the_engine_no_network_library():
    offenders = []
    for path in our_modules():
        module, names = module_name(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        if any(under(n, "torch.distributed") for n in names) and not under(module, "engine.parallel"):
            offenders.append(f"{module} imports torch.distributed")
        network = sorted(n for n in names if under(n, "grpc", "redis", "opentelemetry"))
        if under(module, "engine") and network:
            offenders.append(f"{module} imports {network}")
    assert not offenders, "\n".join(offenders)


def test_nothing_of_ours_pickles():
    users = [module_name(p) for p in our_modules() if "pickle" in imports_of_stdlib(p)]
    assert not users, f"these modules import pickle (messages between processes go through engine.parallel.control): " \
                      f"{users}"


def imports_of_stdlib(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_table_refuses_what_the_layers_forbid():
    """The rules themselves: each forbidden direction is refused (so the first test can fail)."""
    assert not allowed("engine.model", "mesh.rpc")
    assert not allowed("engine.model", "engine.parallel.context")
    assert not allowed("engine.parallel.executor", "engine.core")
    assert not allowed("kvtransfer.pairing", "mesh.rpc")
    assert not allowed("mesh.rpc", "engine.core")
    assert not allowed("mesh.instance", "mesh.supervisor")
    assert not allowed("decode_svc.server", "prefill_svc.push")
    assert not allowed("router.core", "mesh.cli")
    assert not allowed("mesh.supervisor", "decode_svc.server")
    assert not allowed("protos.infermesh", "engine.errors")
    assert allowed("mesh.errors", "engine.errors") and allowed("engine.core", "engine.parallel.executor")
