"""Build the docs as CI does (``make docs``: every warning is an error) and check that the API reference is complete."""

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_fsdp

_DOCS = Path(__file__).resolve().parents[2] / "docs" / "source-fabric"


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = tmp_path_factory.mktemp("docs")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "html"]
    command += ["-d", str(out / "doctrees"), str(_DOCS), str(out / "html")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"the docs build failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return out / "html"


def test_docs_build_without_warnings(built_docs: Path):
    assert (built_docs / "index.html").is_file()
    assert (built_docs / "guide" / "loading_large_checkpoints.html").is_file()
    assert (built_docs / "upstream.html").is_file()


def test_every_guide_page_is_in_the_docs(built_docs: Path):
    for page in sorted((_DOCS / "guide").glob("*.rst")):
        assert (built_docs / "guide" / f"{page.stem}.html").is_file(), f"guide/{page.name} was not built"


def test_api_reference_documents_the_public_api(built_docs: Path):
    text = html.unescape(re.sub(r"<[^>]+>", "", (built_docs / "api.html").read_text(encoding="utf-8")))
    public = [name for name in lightning_fsdp.__all__ if not name.startswith("_")]
    assert public
    missing = [name for name in public if f"lightning_fsdp.{name}" not in text]
    assert not missing, f"the API reference does not document {missing}: give them docstrings"
