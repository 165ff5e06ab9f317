#!/usr/bin/env bash
# Install one extra's pinned packages from pyproject.toml into .venv, by name, where a pin is
# not met (bash scripts/install_extra.sh docs|lint). By name rather than `pip install -e .[X]`
# so that hvdlite's own install is left as it is; the pins stay in pyproject.toml only.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=$(.venv/bin/python - "$1" <<'PY'
import importlib.metadata as md, re, sys
text = open("pyproject.toml", encoding="utf-8").read()
body = re.search(rf"^{sys.argv[1]} = \[(.*?)\]", text, re.M | re.S).group(1)
for pin in re.findall(r'"([^"]+)"', body):
    name, _, version = pin.partition("==")
    try:
        ok = md.version(name.split("[")[0]) == version
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print(pin)
PY
)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  .venv/bin/pip install -q --disable-pip-version-check $missing
fi
