"""The README's picture of the site: its home page, 1280 x 800, in docs/figures/site_home.png.

    python -m maintainer.site.screenshot                 # build the site, open it, take the picture
    python -m maintainer.site.screenshot --out out/home.png

It builds the site with `mkdocs build --strict` into a folder of its own, serves it on 127.0.0.1
and opens it in Debian's Chromium (`apt-get install chromium chromium-driver`), as
tests/test_site.py does. The picture replaces the old one only once it is whole.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from layout import REPO as ROOT
from maintainer.site.browser import build, chromium, serve, why_no_browser

PICTURE = ROOT / "docs" / "figures" / "site_home.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PICTURE, help="where the picture goes")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=800)
    args = parser.parse_args(argv)

    why = why_no_browser()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="course-site-") as scratch:
        site = Path(scratch) / "site"
        try:
            seconds = build(site)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        with serve(site) as address:
            with chromium(Path(scratch) / "profile", args.width, args.height) as driver:
                driver.get(address)
                picture = driver.get_screenshot_as_png()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    partial.write_bytes(picture)
    partial.replace(args.out)
    print(f"built in {seconds:.1f} s; wrote {args.out} ({len(picture) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
