"""JupyterLab on the book: saving an unchanged chapter leaves it byte for byte as it was, jupytext reads every
cell of it, no page carries MyST that JupyterLab shows raw, and the JupyterLab settings `make setup` installs open
the chapters as notebooks without overriding the environment's own settings."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import jupytext
import pytest
from jupytext.config import find_jupytext_configuration_file, load_jupytext_configuration_file

from conftest import BOOK, ROOT

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
    """JupyterLab renders a directive's fence as a code block: an option line (`:class: note`) shows as text. A
    `{literalinclude}` is the exception: JupyterLab shows it as the block naming the file and the object to include."""
    text = path.read_text()
    assert not re.search(r"^```\{(admonition|note|warning)\}[^\n]*\n:\w+:", text, flags=re.M)


def _default_viewers(app_settings: Path) -> dict[str, str]:
    """The default viewers JupyterLab serves for an environment whose settings folder is ``app_settings``."""
    from jupyterlab_server.settings_utils import get_settings

    schemas = Path(sys.prefix, "share", "jupyter", "lab", "schemas")
    found, _ = get_settings(
        str(app_settings), str(schemas), str(app_settings / "user"), "@jupyterlab/docmanager-extension:plugin"
    )
    return found["schema"]["properties"]["defaultViewers"]["default"]


def test_make_setup_installs_the_lab_settings_where_jupyterlab_reads_them(tmp_path):
    """`make setup` copies book/lab-overrides.json into <env>/share/jupyter/lab/settings/overrides.d/; JupyterLab
    opens .md files with jupytext's notebook from there, under what the environment's overrides.json sets."""
    from jupyterlab.commands import get_app_dir

    install = "cp book/lab-overrides.json $(VENV)/share/jupyter/lab/settings/overrides.d/kvwall.json"
    assert install in (ROOT / "Makefile").read_text()
    assert Path(get_app_dir()) == Path(sys.prefix, "share", "jupyter", "lab")  # $(VENV) is this environment
    settings = tmp_path / "settings"
    (settings / "overrides.d").mkdir(parents=True)
    shutil.copy(BOOK / "lab-overrides.json", settings / "overrides.d" / "kvwall.json")
    assert _default_viewers(settings) == {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}
    (settings / "overrides.json").write_text(
        json.dumps({"@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"markdown": "Markdown Preview"}}})
    )
    assert _default_viewers(settings) == {"markdown": "Markdown Preview", "myst": "Jupytext Notebook"}
