"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel, draws its two plots, and is
committed without outputs (tools/make_notebook.py writes it)."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_committed_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.slow
def test_runs_top_to_bottom_and_draws_its_plots():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert sum("image/png" in o.get("data", {}) for o in outputs) == 2
  html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
  assert any("finish_reason" in h for h in html)  # RequestOutput's notebook view
  text = "".join(o.get("text", "") for o in outputs)
  assert "of the time for" in text and "MBU" in text
