"""In a Jupyter notebook: progress bars without ipywidgets are quiet text bars (no red TqdmWarning), and
``verbose=True`` streams text and speeds the way MLX-LM's ``generate(..., verbose=True)`` does."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A Jupyter kernel as tqdm detects one (ipykernel's shell module loaded), ipywidgets not installed; every
# warning is shown (on stderr).
NOTEBOOK = textwrap.dedent("""
    import sys, types, warnings
    warnings.simplefilter("always")
    sys.modules["ipykernel.zmqshell"] = types.ModuleType("ipykernel.zmqshell")
    class ZMQInteractiveShell:  # what tqdm and trio (under httpx) look at
        custom_exceptions = ()
        def set_custom_exc(self, *args): pass
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = ZMQInteractiveShell
    sys.modules["IPython"] = ipython
    sys.modules["ipywidgets"] = None
""")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NOTEBOOK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_the_simulated_notebook_makes_tqdm_auto_warn():
    """The situation of the issue: huggingface_hub's tqdm.auto import warns there."""
    r = run("from huggingface_hub import snapshot_download")
    assert r.returncode == 0 and "TqdmWarning: IProgress not found" in r.stderr, r.stderr


def test_progress_bars_fall_back_to_text_quietly():
    r = run("""
        import tqdm.std
        from lily.progress import import_huggingface_hub, progress_bar
        hub = import_huggingface_hub()
        hub.snapshot_download  # loaded lazily: this imports tqdm.auto
        bar = progress_bar(3, desc="Reading weights", unit="B", unit_scale=True)
        bar.update(3)
        bar.close()
        assert type(bar) is tqdm.std.tqdm, type(bar)
        from lily.hub import resolve_model  # lily.load's download path imports huggingface_hub the same way
    """)
    assert r.returncode == 0, r.stderr
    assert "TqdmWarning" not in r.stderr and "Reading weights: 100%" in r.stderr
