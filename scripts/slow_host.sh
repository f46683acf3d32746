#!/usr/bin/env bash
# Runs a command on a host made about twice as slow: the command and everything it starts
# pinned to one CPU core that a busy loop shares with it (the scheduler gives each about
# half). For timing what depends on the host's speed (a prefill that is bound by the
# host's launches on a slow machine), for every side of a comparison alike.
# Usage: bash scripts/slow_host.sh [--core N] command ...   (default core 2)
set -uo pipefail
core=2
if [[ "${1:-}" == "--core" ]]; then core="$2"; shift 2; fi
taskset -c "$core" bash -c 'while :; do :; done' &
hog=$!
trap 'kill "$hog" 2>/dev/null' EXIT
taskset -c "$core" "$@"
