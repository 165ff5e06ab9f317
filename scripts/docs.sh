#!/usr/bin/env bash
# Build the documentation site into site/ with `mkdocs build --strict`: a broken link, a page
# missing from the nav, a snippet that is not there or a docstring that does not render fails.
#   bash scripts/docs.sh            # build site/ (open site/index.html)
#   bash scripts/docs.sh serve      # live preview on http://127.0.0.1:8000
# The API pages import hvdlite's frontends (torch, TensorFlow, Keras, Ray) to list their public
# names, so the build runs in the project's .venv, which scripts/setup.sh creates.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh
fi
# The `docs` extra's pinned packages, installed by name (not `pip install -e .[docs]`, which
# would also re-point an editable hvdlite at this checkout) when a pin is not met.
bash scripts/install_extra.sh docs
export NO_MKDOCS_2_WARNING=1 TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = serve ]; then
  exec .venv/bin/mkdocs serve
fi
exec .venv/bin/mkdocs build --strict --site-dir site
