#!/usr/bin/env bash
# Install the test-only plugin packages into tests/dummy_plugins/.site, not into the venv:
# some of them are broken or clash with the built-ins on purpose, and in the venv they would
# break every engine started there. The tests put .site on sys.path / PYTHONPATH themselves.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
rm -rf "$here/.site"
"$python" -m pip install --quiet --no-deps --no-build-isolation --target "$here/.site" \
    "$here/good" "$here/broken_import" "$here/misspelt_hook" "$here/duplicate_name" \
    "$here/bad_signature"
# pip builds in place; leave the source folders as they were.
rm -rf "$here"/*/build "$here"/*/*.egg-info
echo "dummy plugins installed in $here/.site"
