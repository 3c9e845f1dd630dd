"""Look at the documentation site in a real browser: build it, serve it on 127.0.0.1, open pages in headless
Chromium and save a screenshot of each.

    python docs/hooks/screenshots.py [--out DIR] [--pages index.md compression.md ...] [--no-build]

Needs the `docs` extra and Chromium (Debian: `apt-get install chromium`; or --chromium PATH). The site is built into
a temporary folder with `mkdocs build --strict`; the server is Python's own, on a free port of 127.0.0.1; Chromium
runs headless with a fresh profile and nothing that reaches the network. Prints the path of each PNG.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: the pages looked at by default: the home page and the compression page (tables, the curve, formulae elsewhere)
PAGES = ("index.md", "compression.md", "concepts.md")
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_chromium() -> str | None:
    """The Chromium executable on PATH, or None."""
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def build_site(site_dir: Path) -> None:
    """`mkdocs build --strict` of the project into `site_dir`; raises CalledProcessError with mkdocs' output."""
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site_dir)],
        cwd=PROJECT_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass


def serve(site_dir: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """A server of `site_dir` on a free port of 127.0.0.1, running in a daemon thread; (server, base URL)."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def page_url(base: str, page: str) -> str:
    """The served URL of a docs page (`index.md` -> base, `compression.md` -> base + 'compression/')."""
    stem = page.removesuffix(".md")
    return base if stem == "index" else f"{base}{stem}/"


def screenshot(chromium: str, url: str, png: Path, profile: Path, size: str = "1280,2400", timeout: float = 120) -> None:
    """Open `url` in headless Chromium with a fresh profile and save a `size` screenshot to `png`; MathJax gets a
    few seconds of virtual time to typeset."""
    command = [
        chromium,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--window-size={size}",
        "--virtual-time-budget=15000",
        f"--screenshot={png}",
        url,
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=timeout)
    if not png.is_file() or png.stat().st_size == 0:
        raise RuntimeError(f"Chromium wrote no screenshot of {url}")


def take_screenshots(out: Path, pages=PAGES, chromium: str | None = None, site_dir: Path | None = None) -> list[Path]:
    """Build the site (unless `site_dir` is given, already built), serve it and save one PNG per page into `out`."""
    chromium = chromium or find_chromium()
    if chromium is None:
        raise RuntimeError("no Chromium found: apt-get install chromium, or pass --chromium PATH")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="relational-hf-site-") as tmp:
        if site_dir is None:
            site_dir = Path(tmp) / "site"
            build_site(site_dir)
        server, base = serve(site_dir)
        try:
            shots = []
            for page in pages:
                png = out / f"{page.removesuffix('.md').replace('/', '_')}.png"
                profile = Path(tempfile.mkdtemp(prefix="profile-", dir=tmp))
                screenshot(chromium, page_url(base, page), png, profile)
                shots.append(png)
            return shots
        finally:
            server.shutdown()
            server.server_close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="site-screenshots", help="folder for the PNGs (default: site-screenshots)")
    parser.add_argument("--pages", nargs="+", default=list(PAGES), help="docs pages to open (default: %(default)s)")
    parser.add_argument("--chromium", help="the Chromium executable (default: found on PATH)")
    parser.add_argument("--site-dir", help="serve this built site instead of building one")
    args = parser.parse_args(argv)
    site = Path(args.site_dir) if args.site_dir else None
    for png in take_screenshots(Path(args.out), args.pages, args.chromium, site):
        print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
