#!/usr/bin/env bash
# The GPU suite: one device-tool call = setup, then the parts of benchmarks/gpu_suite.py in value order
# against one deadline, then the log tarball. notes/gpu_plan.md has the two calls a GPU session makes.
#
#   GPU_SUITE_CALL_S=450 bash benchmarks/gpu_suite.sh OUT [--dry-run] [--sim-clock] [--fresh]
#   bash benchmarks/gpu_suite.sh --build-wheels        # on the CPU machine, before asking for a GPU
#
# The order (gpu_suite.py's DEFAULT_ORDER): pre-flight (imports of torch, deepspeed, datasets and the
# harness, CUDA visible, one tiny step: the call ends in one line if it fails), facts, the strategies
# torch first (ddp, fsdp, fsdp_grad_op, fsdp_offload) then DeepSpeed (zero1, zero2, zero3, zero2_offload,
# zero3_offload), llama-1.6b bf16 eager throughput (MFU), the long-sequence rung (the planner's longest
# seq_len vs the longest that runs), the eager s004 rows, then compile=block if time is left. Compiled matrix rows are out of the default.
# Meanwhile the host saves both models once as bf16 safetensors (runs load them by path) and prepares
# their data caches. Every finished item is in OUT at once (results.json, gpu.md); a part stops after
# two identical failures; a second call on the warm machine goes on where the first stopped.
#
# Knobs (environment):
#   GPU_SUITE_CALL_S       seconds this call may take, setup and tarball included (default 450)
#   GPU_SUITE_ORDER        comma-separated parts, replacing the default order (optional parts:
#                          throughput_model, matrix_compiled, matrix_table)
#   GPU_SUITE_MATRIX_ROWS / GPU_SUITE_MATRIX_COMPILED_ROWS   ';'-separated row names, in order
#   GPU_SUITE_MATRIX_SET   key=value overrides of every matrix row (default "steps=8 memory.track_every=1000")
#   GPU_SUITE_THROUGHPUT_MICRO   the throughput runs' micro-batch (default 8; halved once on out-of-memory)
#   GPU_SUITE_LONG_AC      the long-sequence rung's activation checkpointing (default none; full: ~1M tokens, slow)
#   GPU_SUITE_COLD_FROM    second call: if the state folder is new (machine went cold), start at this part
#   GPU_SUITE_RETRY_FAILED=1   run again what failed in an earlier call (default: only what was not reached)
#   GPU_SUITE_STATE, PY, GPU_SUITE_FRESH=1 (= --fresh)
# --dry-run: this CPU machine, the repo's .venv, tiny models, 2 steps; --sim-clock (with --dry-run):
# train nothing, each run spends its GPU estimate on a simulated clock (the rehearsal of the calls).
#
# The GPU machine has torch 2.11 + CUDA, transformers, accelerate, no DeepSpeed (nor pydantic/hjson),
# no datasets (nor dill/multiprocess), no network. --build-wheels makes wheels/ (git-ignored, ~6 MiB;
# name it in `carry`) with the repo's venv: DeepSpeed built as a pure wheel from its sdist, and the
# venv's versions of pydantic(-core), annotated-types, typing-inspection, hjson, datasets, dill,
# multiprocess; typing-extensions into wheels/fallback (installed only if pydantic needs it).
# Setup installs them with --no-index --no-deps (torch is never touched; checked before and after)
# and starts DeepSpeed's CPU Adam JIT build in the background; the harness runs from PYTHONPATH.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
T0=$(date +%s)

build_wheels() {
    local py=${PY:-$REPO/.venv/bin/python}
    cd "$REPO" || exit 2
    ver() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
    local plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)
    rm -rf wheels && mkdir -p wheels/fallback
    set -e
    "$py" -m pip wheel -q --no-deps --no-build-isolation -w wheels "deepspeed==$(ver deepspeed)"
    "$py" -m pip download -q --no-deps "${plat[@]}" -d wheels "pydantic-core==$(ver pydantic-core)"
    local pure=()
    for p in pydantic annotated-types typing-inspection hjson datasets dill multiprocess; do pure+=("$p==$(ver "$p")"); done
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d wheels "${pure[@]}"
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d wheels/fallback "typing-extensions==$(ver typing-extensions)"
    set +e
    grep -qx '/wheels/' .gitignore || echo '/wheels/' >> .gitignore
    ls -la wheels wheels/fallback
    du -sh wheels
}

if [[ "${1:-}" == "--build-wheels" ]]; then build_wheels; exit $?; fi
if [[ $# -lt 1 || "$1" == -* ]]; then sed -n '2,36p' "${BASH_SOURCE[0]}"; exit 2; fi
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
shift
DRY=${GPU_SUITE_DRY_RUN:-0} FRESH=${GPU_SUITE_FRESH:-0} SIM=0
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=1 ;;
        --sim-clock) SIM=1 ;;
        --fresh) FRESH=1 ;;
        *) echo "gpu_suite.sh: unknown argument '$a' (--dry-run, --sim-clock, --fresh)" >&2; exit 2 ;;
    esac
done
if [[ "$SIM" == 1 && "$DRY" != 1 ]]; then echo "gpu_suite.sh: --sim-clock is a rehearsal: add --dry-run" >&2; exit 2; fi
CALL_S=${GPU_SUITE_CALL_S:-450}
cd "$REPO" || exit 2

FLAGS=()
if [[ "$DRY" == 1 ]]; then
    FLAGS=(--dry-run)
    [[ "$SIM" == 1 ]] && FLAGS+=(--sim-clock)
    PY=${PY:-$REPO/.venv/bin/python}
    STATE=${GPU_SUITE_STATE:-$REPO/runs/gpu_suite_dry}
    export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
else
    PY=${PY:-python3}
    STATE=${GPU_SUITE_STATE:-$REPO/runs/gpu_suite}
fi
[[ "$FRESH" == 1 ]] && rm -rf "$STATE"
mkdir -p "$STATE/logs"
export PY HARNESS_CACHE="$STATE/cache" WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
[[ -f "$STATE/env.sh" ]] && source "$STATE/env.sh"   # written by setup (a --target site folder, CUDA_HOME)
exec > >(tee -a "$STATE/logs/suite.log") 2>&1
echo "=== gpu_suite.sh $( [[ $DRY == 1 ]] && echo '(dry run) ')$( [[ $SIM == 1 ]] && echo '(simulated clock) ')at $(date -u +%FT%TZ): ${CALL_S}s; python $PY; state $STATE; out $OUT"

SETUP_S=0   # what the simulated clock charges for setup: its GPU estimate, the first time only
setup() {
    if [[ -f "$STATE/.setup_done" ]]; then echo "setup: done earlier in this state folder"; return 0; fi
    SETUP_S=20
    if [[ "$DRY" == 1 ]]; then
        "$PY" -c "import json,sys; json.dump({'summary': 'dry run: the repo venv as it is, nothing installed'}, open(sys.argv[1],'w'))" "$STATE/setup.json"
        touch "$STATE/.setup_done"
        return 0
    fi
    local notes=() torch_before torch_after pipq=(-q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
    torch_before=$("$PY" -c "import torch; print(torch.__version__)" 2>&1)
    if "$PY" -c "import deepspeed, datasets" >/dev/null 2>&1; then
        notes+=("deepspeed and datasets already importable; wheels not installed")
    elif compgen -G "wheels/*.whl" >/dev/null; then
        if timeout 120 "$PY" -m pip install "${pipq[@]}" wheels/*.whl; then
            notes+=("installed $(ls wheels/*.whl | wc -l) wheels into $("$PY" -c 'import sys; print(sys.prefix)')")
        else
            echo "pip install into the interpreter failed; trying --target $STATE/site"
            timeout 120 "$PY" -m pip install "${pipq[@]}" --upgrade --target "$STATE/site" wheels/*.whl
            echo "export PYTHONPATH=\"\$PYTHONPATH:$STATE/site\"" > "$STATE/env.sh"
            source "$STATE/env.sh"
            notes+=("wheels installed with --target $STATE/site (PYTHONPATH)")
        fi
        # pydantic (DeepSpeed's config) wants typing-extensions >= 4.16: upgrade the image's only if deepspeed does not import
        if compgen -G "wheels/fallback/*.whl" >/dev/null && ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
            timeout 60 "$PY" -m pip install "${pipq[@]}" --upgrade wheels/fallback/*.whl \
                && notes+=("upgraded typing-extensions from wheels/fallback (deepspeed did not import without it)")
        fi
    else
        notes+=("NO wheels/ folder carried: the pre-flight will stop the call (see notes/gpu_plan.md)")
    fi
    torch_after=$("$PY" -c "import torch; print(torch.__version__)" 2>&1)
    [[ "$torch_before" != "$torch_after" ]] && notes+=("WARNING: torch changed from $torch_before to $torch_after")
    notes+=("torch $torch_after")
    # DeepSpeed's CPU Adam is a C++ op built on first use (JIT, ~1.5-2 min, no nvcc needed): start it now, in
    # the background; the offload rows come last among the strategies, minutes later.
    if command -v nvcc >/dev/null; then export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}; fi
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    # one build folder for the background build and every run (harness would otherwise pick its environment's own)
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$STATE/torch_extensions}
    echo "export CUDA_HOME=\"${CUDA_HOME:-}\" TORCH_CUDA_ARCH_LIST=\"$TORCH_CUDA_ARCH_LIST\" TORCH_EXTENSIONS_DIR=\"$TORCH_EXTENSIONS_DIR\"" >> "$STATE/env.sh"
    rm -f "$STATE/cpu_adam_build.rc"
    ( timeout 400 "$PY" -c "import time; t=time.time(); from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('CPUAdamBuilder loaded in %.0f s' % (time.time()-t))" \
        >"$STATE/logs/cpu_adam_build.log" 2>&1; echo $? >"$STATE/cpu_adam_build.rc" ) &
    local summary
    summary=$(printf '%s; ' "${notes[@]}")
    "$PY" -c "import json,sys; json.dump({'summary': sys.argv[2]}, open(sys.argv[1],'w'))" "$STATE/setup.json" "$summary"
    echo "setup: $summary"
    touch "$STATE/.setup_done"
}

tarball() {  # every run's log, config, metrics, state_bytes, plan; the models' config.json (no weights)
    tar czf "$OUT/logs.tar.gz" -C "$STATE" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude='*.npy' \
        --exclude='checkpoints' --exclude='cache' --exclude='site' logs runs matrix models results.json setup.json 2>/dev/null
    if [[ $(stat -c %s "$OUT/logs.tar.gz" 2>/dev/null || echo 0) -gt 15000000 ]]; then   # files come back at <= 16 MiB
        tar czf "$OUT/logs.tar.gz" -C "$STATE" --exclude='*.safetensors' --exclude='*.png' --exclude='cache' --exclude='site' \
            logs models results.json 2>/dev/null
    fi
}

setup
DEADLINE=$((T0 + CALL_S - 20))   # 20 s for the tarball and the transfer's margin
LEFT=$((DEADLINE - $(date +%s)))
timeout --kill-after=10 $((LEFT + 10)) "$PY" benchmarks/gpu_suite.py --state "$STATE" --out "$OUT" --deadline "$DEADLINE" \
    --started "$T0" --setup-s "$SETUP_S" "${FLAGS[@]}"
RC=$?
(( RC == 124 || RC == 137 )) && echo "gpu_suite: the parts outran the call's deadline and were stopped"
tarball
echo "=== done in $(( $(date +%s) - T0 ))s (exit $RC): $OUT/gpu.md $OUT/results.json $OUT/logs.tar.gz"
exit "$RC"
