"""Progress bars: tqdm's, as MLX-LM and huggingface_hub show them.

In a Jupyter notebook with ipywidgets installed, a widget; everywhere else (a terminal, a log file, a notebook
without ipywidgets) a text bar on stderr. ``tqdm.auto`` makes the same choice but warns (``TqdmWarning``,
printed in red in a notebook) when ipywidgets is missing; these functions fall back quietly.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

__all__ = ["import_huggingface_hub", "progress_bar"]


def _tqdm_class():
    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TqdmWarning)  # ipywidgets missing, or notebook mode "experimental"
        from tqdm.autonotebook import tqdm
    return tqdm


def progress_bar(total: float | None = None, *, desc: str = "", unit: str = "it", leave: bool = True,
                 disable: bool = False, **kwargs: Any):
    """A tqdm bar (see the module docstring); ``leave=False`` clears it when it closes."""
    return _tqdm_class()(total=total, desc=desc, unit=unit, leave=leave, disable=disable, file=sys.stderr,
                         dynamic_ncols=True, **kwargs)


def import_huggingface_hub():
    """``huggingface_hub``, imported without the TqdmWarning its ``tqdm.auto`` import prints in a notebook
    without ipywidgets (its download bars then are text bars)."""
    _tqdm_class()  # tqdm.autonotebook warns once, when first imported
    import huggingface_hub

    return huggingface_hub
