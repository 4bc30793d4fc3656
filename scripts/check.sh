#!/usr/bin/env bash
# The static checks:   bash scripts/check.sh
#  - the docs site (mkdocs.yml, docs/): any broken link, anchor or include fails the build. Not -q:
#    in mkdocs 1.6 -q hides the warnings from --strict, which then passes whatever they say;
#  - style: ruff's lint and its formatting, over the whole repository ([tool.ruff] in pyproject.toml);
#  - types: hosted_tinker/ checks clean under [tool.mypy] (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$(mktemp -d)"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
