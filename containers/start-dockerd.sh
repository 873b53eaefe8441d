#!/usr/bin/env bash
# Starts the Docker daemon when none answers (CI machines and this dev box have the client only), logging
# to $LOG, and waits until `docker info` answers. Idempotent.
set -euo pipefail
LOG=${LOG:-/tmp/dockerd.log}
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
if docker info >/dev/null 2>&1; then exit 0; fi
command -v dockerd >/dev/null || ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq docker.io)
$SUDO sh -c "nohup dockerd >'$LOG' 2>&1 &"
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "dockerd did not answer within 60 s; its log: $LOG" >&2
tail -20 "$LOG" >&2
exit 1
