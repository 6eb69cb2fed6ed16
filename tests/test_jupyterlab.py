"""JupyterLab on the book: saving an unchanged chapter leaves it byte for byte as it was, jupytext reads every
cell of it, no page carries MyST that JupyterLab shows raw, and `make setup` merges the book's JupyterLab
settings into an environment's own instead of replacing them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jupytext
import pytest
from jupytext.config import find_jupytext_configuration_file, load_jupytext_configuration_file

from conftest import BOOK
from kvwall.reports.lab_settings import install_overrides, merge_settings

PAGES = sorted(BOOK.glob("*.md"))
CONFIG = load_jupytext_configuration_file(find_jupytext_configuration_file(str(BOOK)))


def _as_jupyterlab_leaves_it(path: Path):
    """The notebook JupyterLab holds after opening ``path`` and running it: jupytext's reading, plus the kernel's
    language_info and the cell metadata a run adds."""
    notebook = jupytext.read(path, config=CONFIG)
    notebook.metadata["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"}
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.metadata["execution"] = {"iopub.status.busy": "2026-11-30T00:00:00Z"}
            cell.metadata["scrolled"] = True
    return notebook


def test_the_project_config_is_the_one_jupytext_finds():
    assert find_jupytext_configuration_file(str(BOOK)) == str(BOOK / "jupytext.toml")


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_saving_an_unchanged_page_leaves_it_byte_identical(path):
    text = path.read_text()
    saved = jupytext.writes(_as_jupyterlab_leaves_it(path), fmt="md:myst", config=CONFIG)
    assert saved == text, f"{path.name}: JupyterLab's save would rewrite it (check its header and book/jupytext.toml)"


def test_open_and_save_through_jupyterlabs_contents_manager(tmp_path):
    """The server side of JupyterLab: jupytext's contents manager, serving a copy of book/ as `make lab` serves
    book/, opens each page as a notebook and saves it back (after the kernel has added its language_info)."""
    from jupyter_server.services.contents.largefilemanager import LargeFileManager
    from jupytext.sync_contentsmanager import build_sync_jupytext_contents_manager_class

    shutil.copy(BOOK / "jupytext.toml", tmp_path)
    manager = build_sync_jupytext_contents_manager_class(LargeFileManager)(root_dir=str(tmp_path))
    for page in PAGES:
        shutil.copy(page, tmp_path)
        model = manager.get(page.name, type="notebook")
        model["content"]["metadata"]["language_info"] = {"name": "python", "version": "3.11.7"}
        manager.save(model, page.name)
        assert (tmp_path / page.name).read_text() == page.read_text(), f"saving {page.name} changed it"


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_jupytext_reads_every_code_cell(path):
    """A fence jupytext cannot parse (e.g. a four-backtick directive) silently drops the rest of the page."""
    fences = len(re.findall(r"^```\{code-cell\}", path.read_text(), flags=re.M))
    cells = jupytext.read(path, config=CONFIG).cells
    assert sum(c.cell_type == "code" for c in cells) == fences


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_no_directive_options_that_jupyterlab_shows_raw(path):
    """JupyterLab renders a directive's fence as a code block: an option line (`:class: note`) shows as text."""
    text = path.read_text()
    assert not re.search(r"^```\{(admonition|note|warning|literalinclude)\}[^\n]*\n:\w+:", text, flags=re.M)
    assert "````" not in text, "jupytext drops everything after a four-backtick fence"


def test_merge_keeps_the_users_settings():
    ours = {"docmanager": {"defaultViewers": {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}}}
    theirs = {"docmanager": {"defaultViewers": {"markdown": "Markdown Preview"}}, "theme": {"name": "dark"}}
    merged, kept = merge_settings(ours, theirs)
    assert merged == {"docmanager": {"defaultViewers": {"markdown": "Markdown Preview", "myst": "Jupytext Notebook"}},
                      "theme": {"name": "dark"}}
    assert kept == ["docmanager.defaultViewers.markdown"]


def test_install_overrides_merges_skips_and_never_clobbers(tmp_path):
    source = BOOK / "lab-overrides.json"
    target = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    assert "merged" in install_overrides(source, tmp_path)
    assert json.loads(target.read_text()) == json.loads(source.read_text())
    assert "already has" in install_overrides(source, tmp_path)
    target.write_text(json.dumps({"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    install_overrides(source, tmp_path)
    merged = json.loads(target.read_text())
    assert merged["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    assert merged.items() >= json.loads(source.read_text()).items()
    target.write_text("{ not json")
    assert "left it unchanged" in install_overrides(source, tmp_path)
    assert target.read_text() == "{ not json"
