"""The documentation site opens in a real browser: built with `mkdocs build --strict`, served on 127.0.0.1 and
loaded in headless Chromium, the home and compression pages give screenshots that are not blank. Skips without
Chromium or without the `docs` extra (`docs/hooks/screenshots.py` is the script; look at its PNGs yourself)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT / "docs" / "hooks"))

import screenshots  # noqa: E402

pytestmark = pytest.mark.slow


def test_page_urls_are_the_served_paths():
    assert screenshots.page_url("http://127.0.0.1:8000/", "index.md") == "http://127.0.0.1:8000/"
    assert screenshots.page_url("http://127.0.0.1:8000/", "compression.md") == "http://127.0.0.1:8000/compression/"


def test_home_and_compression_pages_render_in_chromium(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("the docs extra is not installed (pip install -e '.[docs]')")
    if screenshots.find_chromium() is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium)")
    from PIL import Image

    site = tmp_path / "site"
    screenshots.build_site(site)
    assert (site / "assets" / "mathjax" / "MathJax.js").is_file() and (site / "cli" / "index.html").is_file()
    shots = screenshots.take_screenshots(tmp_path / "shots", ("index.md", "compression.md"), site_dir=site)
    for png in shots:
        with Image.open(png) as image:
            colours = image.convert("RGB").resize((64, 128)).getcolors(64 * 128)
        assert colours is not None and len(colours) > 20, f"{png.name} looks blank"
