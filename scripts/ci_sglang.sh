#!/usr/bin/env bash
# The SGLang conformance suite (tests/engine/sglang_real) against each pinned SGLang release, on CPU.
#
#   bash scripts/ci_sglang.sh [VERSION...]     (default: the releases agentrl supports, below)
#
# SGLang's wheel pins CUDA torch and GPU kernels; its HTTP server, request classes, serializer and
# weight-sync code import without them. Each version goes, once, into its own directory
# (.cache/sglang-VERSION) through scripts/install_sglang_cpu.sh (--no-deps, beside the modules
# its server imports, never into the venv), with the sglang-router wheel next to it. The tests put
# that directory at the front of sys.path through AGENTRL_SGLANG_PATH and skip without it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.5.23 0.5.15.post1)  # the current release; slime's pin
ROUTER=sglang-router==0.3.2

install_version() {
  local version=$1 target=.cache/sglang-$1
  [ -f "$target/.complete" ] && return 0
  echo "== installing sglang==$version into $target (once)"
  rm -rf "$target"
  # The local copy of the wheel when there is one, else PyPI's (install_sglang_cpu.sh downloads).
  local wheel
  wheel=$(ls /tmp/sgl/sglang-"$version"-*.whl 2>/dev/null | head -1 || true)
  SGLANG_WHEEL=$wheel bash scripts/install_sglang_cpu.sh "$version" "$target"
  # The router: a Rust binary in a Python wheel, run as `python -m sglang_router.launch_router`.
  local router_wheel
  router_wheel=$(ls /tmp/sgl/sglang_router-"${ROUTER#*==}"-*.whl 2>/dev/null | head -1 || true)
  pip install -q --no-deps --target "$target" "${router_wheel:-$ROUTER}"
  touch "$target/.complete"
}

# smg (sglang-router's successor, with consistent_hashing): its own directory, for the router test.
SMG=smg==1.13.0
if [ ! -f .cache/smg/.complete ]; then
  rm -rf .cache/smg
  pip install -q --target .cache/smg "$SMG"  # with setproctitle, grpcio, pyyaml: it imports them
  touch .cache/smg/.complete
fi

# The tests that run SGLang's own code or the router binaries. The rest of tests/engine/sglang_client
# (the client's and the launcher's unit tests, which put a stand-in `sglang` on sys.path) runs in
# the ordinary suite, without SGLang.
SUITE=(
  tests/engine/sglang_real
  tests/engine/sglang_client/test_sglang_client_fixes.py
  tests/engine/sglang_client/test_sglang_dialect.py
  tests/engine/sglang_client/test_sglang_real_classes.py
  tests/engine/sglang_client/test_sglang_router_binary.py
  tests/engine/sglang_client/test_train_through_router.py
)

status=0
for version in "${VERSIONS[@]}"; do
  install_version "$version"
  # Each version in a process of its own: its directory goes first on sys.path.
  echo "== the SGLang suite (${SUITE[*]}) against sglang $version"
  AGENTRL_SGLANG_PATH=$PWD/.cache/sglang-$version AGENTRL_SMG_PATH=$PWD/.cache/smg \
    python -m pytest -q "${SUITE[@]}" || status=1
done
exit $status
