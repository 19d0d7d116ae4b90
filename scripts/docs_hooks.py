"""mkdocs hook: serve every committed benchmark result (benchmarks/results/**) under
results/ in the site, as it is in the repository, so the docs link each results.md (and its
plots) instead of copying their tables; and the root CHANGELOG.md as changelog.md. Nothing
is written into docs/."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in (".md", ".png", ".json"):
            uri = "results/" + path.relative_to(RESULTS).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    # the changelog lives at the repository's root, where people look for it
    files.append(File.generated(config, "changelog.md", abs_src_path=str(ROOT / "CHANGELOG.md")))
    return files
