"""The package's folders import in one direction, at module level only:

  model -> sharding -> checkpoints -> decode -> the user-facing modules at the root (llm, cli, serve/, ...)

Each folder may import only the folders before it. The check reads the source (ast), so it sees
imports that are never executed; a function-local import of jaxgen would hide a cycle and is
refused too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ORDER = ("model", "sharding", "checkpoints", "decode")  # then the root modules
ROOT_FOLDERS = ("serve",)  # folders of the root layer (they may import the root modules, and they them)
ROOT_RANK = len(ORDER)


def rank(module: str) -> int | None:
  """The layer of a jaxgen module name ('jaxgen.model.kv' -> 0, 'jaxgen.llm' -> 4); None: not jaxgen."""
  parts = module.split(".")
  if parts[0] != "jaxgen":
    return None
  if len(parts) == 1:
    return ROOT_RANK
  return ORDER.index(parts[1]) if parts[1] in ORDER else ROOT_RANK


def violations(root: pathlib.Path) -> list[str]:
  """Every import of jaxgen that goes against the layer order or is not at module level."""
  found = []
  folders = ORDER + ROOT_FOLDERS
  for file in sorted(root.glob("*.py")) + sorted(f for d in folders for f in (root / d).rglob("*.py")):
    rel = file.relative_to(root)
    mine = ORDER.index(rel.parts[0]) if len(rel.parts) > 1 and rel.parts[0] in ORDER else ROOT_RANK
    tree = ast.parse(file.read_text(), str(rel))
    # Module level: the body, and `if TYPE_CHECKING:` blocks (imports for annotations, never run).
    typing_only = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    top_level = {id(n) for n in tree.body} | {id(n) for block in typing_only for n in block.body}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        continue
      theirs = [r for r in map(rank, names) if r is not None]
      if not theirs:
        continue
      if id(node) not in top_level:
        found.append(f"{rel}:{node.lineno} imports jaxgen inside a function or block")
      elif max(theirs) > mine and rel.name != "__init__.py":
        found.append(f"{rel}:{node.lineno} imports {names[0]} (layer {max(theirs)}) from layer {mine}")
  return found


def test_folders_import_in_one_direction_at_module_level():
  assert violations(ROOT) == []


def test_the_check_catches_a_back_import_and_a_hidden_one(tmp_path):
  for d in ORDER:
    (tmp_path / d).mkdir()
  (tmp_path / "model" / "layers.py").write_text("import jax\nfrom jaxgen.decode import engine\n")
  (tmp_path / "sharding" / "rules.py").write_text("from jaxgen.model import layers\n\n"
                                                  "def f():\n  from jaxgen.model import kv\n")
  (tmp_path / "decode" / "engine.py").write_text("from jaxgen.checkpoints import source\nimport jaxgen.model.kv\n")
  (tmp_path / "llm.py").write_text("from jaxgen.decode.engine import Engine\n")
  found = violations(tmp_path)
  assert found == ["model/layers.py:2 imports jaxgen.decode (layer 3) from layer 0",
                   "sharding/rules.py:4 imports jaxgen inside a function or block"]


@pytest.mark.parametrize("module,want", [("jaxgen.model.kv", 0), ("jaxgen.sharding", 1), ("jaxgen.llm", 4),
                                         ("jaxgen", 4), ("numpy", None)])
def test_rank(module, want):
  assert rank(module) == want
