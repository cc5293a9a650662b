"""The package's rooms: a lower room never imports a higher one."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "muon_optax"
# Each room and the rooms it may import (besides itself). The parts and aliases at the
# top, `checkpoint` and `nnx` may import any room.
ALLOWED = {
    "_version": set(),
    "_util": set(),
    "_newton_schulz": {"_util"},
    "_adamw": {"_util"},
    "_distributed": {"_util", "_newton_schulz"},
    "_routing": {"_util", "_newton_schulz"},
}


def _room(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and parts[0] == "muon_optax" else ""


def _imports(path: pathlib.Path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == "muon_optax":
        yield from (f"muon_optax.{a.name}" for a in node.names)
      else:
        yield node.module
    elif isinstance(node, ast.Import):
      yield from (a.name for a in node.names)


def test_lower_rooms_never_import_higher_ones():
  bad = []
  for path in PACKAGE.rglob("*.py"):
    here = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    if here not in ALLOWED:
      continue
    for module in _imports(path):
      room = _room(module)
      if room and room != here and room not in ALLOWED[here]:
        bad.append(f"{path.relative_to(PACKAGE)} imports {module}")
  assert not bad, "\n".join(bad)


def test_every_module_sits_in_a_known_room_or_on_top():
  top = {"__init__", "_alias", "_momentum", "_orthogonalize", "_qk_clip", "_scaling",
         "_second_moment", "_row_selection", "_block_periodic", "_weight_decay", "_hyperball",
         "nnx", "checkpoint"}
  rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*")
           if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
  assert rooms <= top | set(ALLOWED), rooms - top - set(ALLOWED)
