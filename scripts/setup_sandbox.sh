#!/usr/bin/env bash
# CI step for the sandbox tests: install bubblewrap and Docker, start dockerd if no daemon
# answers, and build the sandbox image offline (host Python tarred into a rootfs, `docker
# import`ed). Idempotent; run as root. Usage: scripts/setup_sandbox.sh
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "setup_sandbox.sh: run as root (it installs packages and starts dockerd)" >&2
  exit 1
fi

if ! command -v bwrap >/dev/null || ! command -v dockerd >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap docker.io
fi

if ! docker info >/dev/null 2>&1; then
  nohup dockerd --storage-driver=overlay2 --iptables=false --bridge=none >/tmp/dockerd.log 2>&1 &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not come up; see /tmp/dockerd.log" >&2; tail -20 /tmp/dockerd.log >&2; exit 1; }
fi

python -c "import docker" 2>/dev/null || pip install -q "docker>=7"
# The image holds the system interpreter (/usr/bin/python3) and its stdlib; no registry needed.
python -m agentrl.tools.sandbox.image
bwrap --version
docker images agentrl-sandbox
