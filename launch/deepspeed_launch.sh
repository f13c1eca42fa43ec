#!/usr/bin/env bash
# Multi-node DeepSpeed launch from the head node:
#   launch/deepspeed_launch.sh <run.yaml> [ds_config] [key=value ...]
# Uses launch/hostfile (override with HOSTFILE=...). The ds_config becomes the run's strategy.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
config=${1:?usage: deepspeed_launch.sh <run.yaml> [ds_config] [key=value ...]}
strategy=${2:-zero3}
shift $(( $# >= 2 ? 2 : 1 ))
exec deepspeed --hostfile "${HOSTFILE:-$here/hostfile}" --master_port "${MASTER_PORT:-29500}" \
    "$here/../harness/train.py" --config "$config" "strategy=$strategy" "$@"
