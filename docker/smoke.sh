#!/usr/bin/env bash
# Smoke test of the container image: build it, run one small command offline (--network none) with a
# host folder mounted at /runs, and fail unless the container succeeds and leaves its output there.
#
#   bash docker/smoke.sh
#
# Environment (all optional):
#   CONTAINER_TOOL  command used as "docker"/"podman", e.g. "docker", "podman", "sudo podman". Default:
#                   the wrapper script PODMAN_DOCKER names when set (machines without a Docker engine),
#                   else podman, else docker.
#   IMAGE           image tag to build and run (default aimet-quadapter:smoke)
#   BASE_IMAGE      passed as --build-arg BASE_IMAGE (e.g. a CUDA runtime image)
#   SKIP_BUILD=1    reuse an already built IMAGE
#   RUNS_DIR        host folder mounted at /runs (default: a fresh temporary folder, kept for inspection)
#   SMOKE_ARGS      the aimet-quadapter command line run in the container (split on spaces)
#   SMOKE_OUTPUT    file the command must write, relative to RUNS_DIR
#   SMOKE_EXPECT    text that file must contain
#   RUN_OPTS        extra options for `run` (split on spaces), e.g. "--gpus all" or "-e HF_HUB_OFFLINE=1"
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")

# The smoke command: the offline smoke recipe, its results written under the mounted /runs.
SMOKE_ARGS=${SMOKE_ARGS:-"run recipes/smoke.yaml --out /runs/smoke"}
SMOKE_OUTPUT=${SMOKE_OUTPUT:-smoke/results.json}
SMOKE_EXPECT=${SMOKE_EXPECT:-'"ppl"'}
IMAGE=${IMAGE:-aimet-quadapter:smoke}

die() { echo "smoke: FAIL: $*" >&2; exit 1; }

# ---- which container tool ----
wrapper=""
for w in "${PODMAN_DOCKER:-}"; do
    if [[ -n "$w" && -f "$w" ]]; then wrapper=$w; break; fi
done
if [[ -n "${CONTAINER_TOOL:-}" ]]; then
    read -r -a tool <<<"$CONTAINER_TOOL"
elif [[ -n "$wrapper" ]]; then
    tool=(bash "$wrapper" podman)
    # Make sure python:3.11-slim resolves locally (no Docker Hub here); a no-op once it exists.
    if [[ -z "${BASE_IMAGE:-}" && -z "${SKIP_BUILD:-}" ]]; then
        bash "$wrapper" base >/dev/null
    fi
elif command -v podman >/dev/null; then
    tool=(podman)
elif command -v docker >/dev/null; then
    tool=(docker)
else
    die "neither podman nor docker found (set CONTAINER_TOOL)"
fi
echo "smoke: container tool: ${tool[*]}"

# ---- build ----
if [[ -z "${SKIP_BUILD:-}" ]]; then
    build_args=()
    [[ -n "${BASE_IMAGE:-}" ]] && build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
    echo "smoke: building $IMAGE"
    t0=$SECONDS
    "${tool[@]}" build -f "$here/Dockerfile" "${build_args[@]}" -t "$IMAGE" "$root" || die "image build failed"
    echo "smoke: build took $((SECONDS - t0)) s"
fi
"${tool[@]}" image inspect "$IMAGE" >/dev/null 2>&1 || die "image $IMAGE does not exist"

# ---- run ----
if [[ -z "${RUNS_DIR:-}" ]]; then
    RUNS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/aimet-quadapter-smoke.XXXXXX")
fi
mkdir -p "$RUNS_DIR"
RUNS_DIR=$(cd "$RUNS_DIR" && pwd)
# The container runs as a non-root user (uid 1000): the mounted folder must be writable for it.
chmod 777 "$RUNS_DIR"
rm -rf "${RUNS_DIR:?}/$SMOKE_OUTPUT"

read -r -a smoke_args <<<"$SMOKE_ARGS"
read -r -a run_opts <<<"${RUN_OPTS:-}"
echo "smoke: running: aimet-quadapter ${smoke_args[*]}  (/runs = $RUNS_DIR)"
t0=$SECONDS
rc=0
"${tool[@]}" run --rm --network none -v "$RUNS_DIR:/runs" "${run_opts[@]}" "$IMAGE" "${smoke_args[@]}" || rc=$?
echo "smoke: run took $((SECONDS - t0)) s, exit code $rc"

# ---- check ----
((rc == 0)) || die "the container exited with code $rc"
out="$RUNS_DIR/$SMOKE_OUTPUT"
[[ -e "$out" ]] || die "$out is missing"
if [[ -d "$out" ]]; then
    grep -rqF -- "$SMOKE_EXPECT" "$out" || die "nothing under $out contains $SMOKE_EXPECT"
else
    grep -qF -- "$SMOKE_EXPECT" "$out" || die "$out does not contain $SMOKE_EXPECT"
fi
echo "smoke: OK: $out"
