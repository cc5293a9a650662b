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
    "_placement": {"_util"},
    "_sharded_ns": {"_util", "_newton_schulz", "_placement"},
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


def test_only_the_orthogonalization_enters_the_engine_and_by_its_one_door():
  """The sharded Newton–Schulz engine is a room of its own: outside it, only
  `_orthogonalize` imports it, and only its entry (`muon_optax._sharded_ns`)."""
  bad = []
  for path in PACKAGE.rglob("*.py"):
    rel = path.relative_to(PACKAGE)
    if rel.parts[0] == "_sharded_ns":
      continue
    for module in _imports(path):
      if _room(module) != "_sharded_ns":
        continue
      if str(rel) != "_orthogonalize.py" or module != "muon_optax._sharded_ns":
        bad.append(f"{rel} imports {module}")
  assert not bad, "\n".join(bad)


def test_every_module_sits_in_a_known_room_or_on_top():
  top = {"__init__", "_alias", "_direction", "_momentum", "_orthogonalize", "_qk_clip", "_scaling",
         "_second_moment", "_row_selection", "_block_periodic", "_weight_decay", "_hyperball",
         "nnx", "checkpoint"}
  rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*")
           if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
  assert rooms <= top | set(ALLOWED), rooms - top - set(ALLOWED)


TESTS = pathlib.Path(__file__).resolve().parent


def test_every_module_has_a_test_file_of_its_own():
  """`room/_name.py` is tested in tests/test_name.py or tests/test_room_name.py."""
  missing = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if path.stem == "__init__":
      continue
    module = str(path.relative_to(PACKAGE).with_suffix(""))
    room, _, name = module.rpartition("/")
    name, room = name.lstrip("_"), room.lstrip("_")
    candidates = [f"test_{name}", f"test_{room}_{name}"]
    if not any((TESTS / f"{c}.py").exists() for c in candidates):
      missing.append(module)
  assert not missing, f"modules without tests/test_<module>.py: {missing}"
