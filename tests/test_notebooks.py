"""The tutorials in notebooks/ run top to bottom."""

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.multiprocess
def test_notebooks_execute():
    """Each notebook runs top to bottom, one after the other in one kernel, the user namespace
    cleared before each (every name the kernel did not start with): a kernel and its fork server
    per notebook cost 8-10 s of the suite each. A name one notebook defines and the next uses
    without defining still fails; ``%reset`` would also remove the ``__spec__`` multiprocessing reads."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    whole = nbformat.v4.new_notebook()
    whole.cells.append(nbformat.v4.new_code_cell("_kernel_names = set(globals()) | {'_kernel_names'}"))
    owner = ["(start)"]  # the notebook each cell of the whole comes from
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        whole.cells.append(nbformat.v4.new_code_cell(
            "for _name in set(globals()) - _kernel_names:\n    del globals()[_name]\n"
            f"import os\nos.chdir({str(path.parent)!r})\ndel os"))
        owner.append(path.name)
        for cell in nb.cells:
            whole.cells.append(cell)
            owner.append(path.name)
    assert len(NOTEBOOKS) == 4, NOTEBOOKS
    try:
        nbclient.NotebookClient(whole, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOKS[0].parent)}}).execute()
    except nbclient.exceptions.CellExecutionError as exc:
        failed = next((i for i, c in enumerate(whole.cells) if any(o.get("output_type") == "error"
                                                                     for o in c.get("outputs", []))), None)
        raise AssertionError(f"{owner[failed] if failed is not None else '?'}: {exc}") from None
    errors = [(owner[i], o) for i, c in enumerate(whole.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
