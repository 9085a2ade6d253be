"""Model code knows nothing of the network; the pure protocol modules import no I/O."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"asyncio", "hivemind", "socket", "islands.node", "uvloop"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _bad(names: set[str], forbidden: set[str]) -> set[str]:
    return {n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden)}


def test_models_import_no_network_and_no_protocols():
    for path in (ROOT / "models").glob("*.py"):
        assert not _bad(_imports(path), FORBIDDEN | {"islands.protocols"}), path


def test_pure_protocol_modules_import_no_io():
    for path in (ROOT / "protocols").glob("*.py"):
        assert not _bad(_imports(path), FORBIDDEN), path
