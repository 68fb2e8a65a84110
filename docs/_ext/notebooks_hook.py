"""mkdocs hook: execute ``notebooks/*.ipynb`` at build time and put them, with their figures, on the
site.

Every notebook is executed (``nbclient``, in its fast setting unless ``PVI_FULL=1``) into
``.cache/notebooks/``; a notebook that raises fails the build, so the site never shows stale or
broken output. An executed notebook is reused while neither it nor the library's sources
(``numpyro_pvi/``, ``examples/``) nor ``PVI_FULL`` changed. The executed notebooks become the pages
``notebooks/<name>.ipynb`` (rendered by ``mkdocs-jupyter``, which does not execute them again), and
the first figure of every cell tagged ``gallery-<slug>`` becomes ``gallery/<slug>.png`` for
``gallery.md``.

Set ``PVI_DOCS_EXECUTE=0`` to skip execution while editing the docs: the pages then show the newest
executed copy in the cache, even if stale (or the stored, output-free notebook if there is none).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.notebooks")
ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "notebooks"
CACHE = ROOT / ".cache" / "notebooks"
TIMEOUT = 1800  # seconds per cell
GALLERY_TAG = "gallery-"
PAGES = CACHE / "pages"  # the site's generated files: notebooks/<name>.ipynb, gallery/<slug>.png

_executed: dict[str, Path] = {}  # notebook name -> executed notebook
_figures: dict[str, Path] = {}  # gallery slug -> png


def _key(path: Path) -> str:
    """A hash of the notebook, the library's sources, this hook and the setting: an executed copy is
    valid while they hold."""
    digest = hashlib.sha256(path.read_bytes())
    digest.update(Path(__file__).read_bytes())
    for source in sorted(
        [*(ROOT / "numpyro_pvi").rglob("*.py"), *(ROOT / "examples").glob("*.py")]
    ):
        digest.update(source.read_bytes())
    digest.update(os.environ.get("PVI_FULL", "0").encode())
    return digest.hexdigest()[:16]


def _execute(path: Path) -> Path:
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    target = CACHE / f"{path.stem}-{_key(path)}.ipynb"
    if target.exists():
        log.info("notebook %s: executed copy %s is current", path.name, target.name)
        return target
    log.info("executing notebook %s", path.name)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    except CellExecutionError as error:
        raise PluginError(
            f"notebook {path.name} failed while the docs were built:\n{error}"
        ) from error
    CACHE.mkdir(parents=True, exist_ok=True)
    for stale in CACHE.glob(f"{path.stem}-*.ipynb"):
        stale.unlink()
    tmp = target.with_suffix(".tmp")
    nbformat.write(notebook, tmp)
    tmp.replace(target)
    return target


def _gallery(name: str, path: Path) -> dict[str, Path]:
    """The first PNG of every cell tagged ``gallery-<slug>``, written to ``gallery/<slug>.png`` of
    the pages."""
    figures = {}
    for cell in nbformat.read(path, as_version=4).cells:
        slugs = [
            t[len(GALLERY_TAG) :]
            for t in cell.get("metadata", {}).get("tags", [])
            if t.startswith(GALLERY_TAG)
        ]
        pngs = [
            o["data"]["image/png"]
            for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})
        ]
        for slug in slugs:
            if not pngs:
                raise PluginError(
                    f"notebook {name}: the cell tagged {GALLERY_TAG}{slug} shows no figure."
                )
            png = PAGES / "gallery" / f"{slug}.png"
            png.parent.mkdir(parents=True, exist_ok=True)
            png.write_bytes(base64.b64decode(pngs[0]))
            figures[slug] = png
    return figures


def _newest_copy(path: Path) -> Path:
    copies = sorted(CACHE.glob(f"{path.stem}-*.ipynb"), key=lambda p: p.stat().st_mtime)
    return copies[-1] if copies else path


def on_pre_build(config: dict) -> None:
    notebooks = sorted(SOURCES.glob("*.ipynb"))
    if os.environ.get("PVI_DOCS_EXECUTE", "1") == "0":
        _executed.update({p.stem: _newest_copy(p) for p in notebooks})
    else:
        # the kernels import this checkout's numpyro_pvi, whatever version is installed
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        )
        # and draw their figures inline, even where the environment picks a non-interactive backend
        # (CI: Agg)
        os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        with ThreadPoolExecutor(max_workers=2) as pool:  # one kernel per notebook: two run at once
            _executed.update(zip((p.stem for p in notebooks), pool.map(_execute, notebooks)))
    for name, path in _executed.items():
        _figures.update(_gallery(name, path))


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the .ipynb files into pages
def on_files(files: Files, config: dict) -> Files:
    (PAGES / "notebooks").mkdir(parents=True, exist_ok=True)
    uris = []
    for name, path in _executed.items():
        (PAGES / "notebooks" / f"{name}.ipynb").write_bytes(path.read_bytes())
        uris.append(f"notebooks/{name}.ipynb")
    uris += [f"gallery/{slug}.png" for slug in _figures]
    for uri in uris:
        files.append(
            File(
                uri,
                src_dir=str(PAGES),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
