#!/usr/bin/env bash
# Issue 16's GPU half: every GPU measurement in one script; writes gpu.md + results.json + logs.tar.gz.
#
#   bash benchmarks/gpu_suite.sh OUT [stage1|stage2|stage3|rest|all ...] [--dry-run] [--fresh]
#   bash benchmarks/gpu_suite.sh --build-wheels          # on the CPU machine, before asking for a GPU
#
# Stages (one device-tool call each: a call runs at most 10 minutes, so the suite is cut in three
# stages of <= ~9.5 min; `all` runs them back to back, ~25 min, where no per-call limit applies):
#   stage1  setup (wheels, editable install, DeepSpeed CPU Adam JIT build in the background), device
#           facts, the strategy table of notes/core.md on the GPU (9 strategies incl. fsdp_offload and
#           DeepSpeed CPU Adam with zero2/zero3_offload; world N too when N GPUs are visible) on a
#           ~320M Llama saved as safetensors and loaded from disk (fsdp/zero3 rows = sharded loads, with
#           the load-phase device peak), harness.plan for each config                      ~7-9 min
#   stage2  llama-1.6b bf16 tokens/s + MFU (eager, compile=block, compile=model), then the compiled
#           rows of experiments/peak_memory_gpu.yaml, harness.plan for each                ~9 min
#   stage3  the eager rows of the matrix, harness.experiments' combined table, plans       ~8 min
#   rest    optional 4th call: whatever is not yet "ok" in the state folder (compiled matrix rows or
#           the compile=model throughput run that did not fit, failed strategies), then the table
# Items already "ok" in the state folder are not run again, so a stage can be repeated after a failure.
# Every part and every run has a time limit; a failing or timed-out run is recorded and the suite
# goes on. What did not fit in the time is recorded as "not run: the stage's time budget was used up".
#
# The GPU machine (see notes/gpu_plan.md) has torch 2.11 + CUDA, transformers and accelerate, but no
# DeepSpeed (nor its pydantic/hjson deps, nor datasets/wandb) and no network. Build the wheels here first:
#   bash benchmarks/gpu_suite.sh --build-wheels     # -> wheels/ (git-ignored; ~5 MiB; name it in `carry`)
# which runs, with the repo's venv:
#   pip wheel --no-deps --no-build-isolation -w wheels deepspeed==<venv's version>    (sdist -> pure wheel)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels pydantic-core==<venv's>
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels pydantic annotated-types \
#       typing-inspection hjson datasets dill multiprocess (each ==<venv's version>)
#   pip download ... -d wheels/fallback typing-extensions   (installed only if pydantic cannot import)
# wandb is not carried: every suite run sets logging.wandb=false and the harness imports it lazily.
#
# Device-tool call (one per stage; timeout_s 600; carry ["wheels"]):
#   bash benchmarks/gpu_suite.sh $OUT stage1        then stage2, then stage3, each right after the last
# On the GPU it installs the wheels into the image's python3 (--no-index --no-deps: torch is never
# touched), then `pip install --no-deps --no-build-isolation --no-index -e .`. State lives in
# runs/gpu_suite/ (git-ignored), kept between calls while the machine stays warm; each call's $OUT
# holds the report of everything in that state. If the machine went cold between calls, merge here:
#   python benchmarks/gpu_report.py <call1>/results.json <call2>/results.json ... --out notes/gpu.md
#
# --dry-run (or GPU_SUITE_DRY_RUN=1): the same parts on this CPU machine with the repo's .venv, tiny
# models, 2 steps, device=cpu, OMP_NUM_THREADS=1; what needs a GPU is recorded as skipped.
# Environment: PY (python to use), GPU_SUITE_STATE (state folder), GPU_SUITE_BUDGET_S (seconds per
# stage, default 570 for one stage per call, 500 per stage with `all`), GPU_SUITE_FRESH=1 (= --fresh).
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
if [[ $# -lt 1 || "$1" == -* ]]; then
    sed -n '2,45p' "${BASH_SOURCE[0]}"; exit 2
fi
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
shift
DRY=${GPU_SUITE_DRY_RUN:-0}
FRESH=${GPU_SUITE_FRESH:-0}
STAGES=()
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=1 ;;
        --fresh) FRESH=1 ;;
        stage1|stage2|stage3|rest|all) STAGES+=("$a") ;;
        *) echo "gpu_suite.sh: unknown argument '$a' (stage1|stage2|stage3|rest|all, --dry-run, --fresh)" >&2; exit 2 ;;
    esac
done
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(all)
cd "$REPO" || exit 2

DRYFLAG=()
if [[ "$DRY" == 1 ]]; then
    DRYFLAG=(--dry-run)
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
[[ -f "$STATE/env.sh" ]] && source "$STATE/env.sh"   # written by setup (e.g. a --target site folder)
exec > >(tee -a "$STATE/logs/suite.log") 2>&1
echo "=== gpu_suite.sh ${STAGES[*]} $( [[ $DRY == 1 ]] && echo '(dry run)') at $(date -u +%FT%TZ); python $PY; state $STATE; out $OUT"

suite() { "$PY" benchmarks/gpu_suite.py --state "$STATE" "${DRYFLAG[@]}" "$@"; }
report() { suite --report "$OUT/gpu.md" "$OUT/results.json" || echo "report failed (exit $?)"; }

CPU_ADAM_PID=""
setup() {
    if [[ "$DRY" == 1 ]]; then
        "$PY" -c "import json,sys; json.dump({'summary': 'dry run: the repo venv as it is, nothing installed'}, open(sys.argv[1],'w'))" "$STATE/setup.json"
        return 0
    fi
    if [[ -f "$STATE/.setup_done" ]]; then echo "setup: done earlier in this state folder"; return 0; fi
    local notes=() torch_before torch_after
    torch_before=$("$PY" -c "import torch; print(torch.__version__)" 2>&1)
    if "$PY" -c "import deepspeed" >/dev/null 2>&1; then
        notes+=("deepspeed already importable; wheels not installed")
    elif compgen -G "wheels/*.whl" >/dev/null; then
        if timeout 300 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check wheels/*.whl; then
            notes+=("installed $(ls wheels/*.whl | wc -l) wheels into $("$PY" -c 'import sys; print(sys.prefix)')")
        else
            echo "pip install into the interpreter failed; trying --target $STATE/site"
            timeout 300 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
                --upgrade --target "$STATE/site" wheels/*.whl
            echo "export PYTHONPATH=\"$STATE/site:\$PYTHONPATH\"" > "$STATE/env.sh"
            source "$STATE/env.sh"
            notes+=("wheels installed with --target $STATE/site (PYTHONPATH)")
        fi
        # pydantic (DeepSpeed's config) wants typing-extensions >= 4.16: upgrade the image's only if older, or if deepspeed fails
        if compgen -G "wheels/fallback/*.whl" >/dev/null && { ! "$PY" -c "import deepspeed" >/dev/null 2>&1 || ! "$PY" -c \
            "import importlib.metadata as m, sys; from packaging.version import Version as V; sys.exit(V(m.version('typing_extensions')) < V('4.16.0'))" \
            >/dev/null 2>&1; }; then
            timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --upgrade wheels/fallback/*.whl \
                && notes+=("upgraded typing-extensions from wheels/fallback (older than pydantic needs, or deepspeed did not import)")
        fi
    else
        notes+=("NO wheels/ folder carried: DeepSpeed strategies will fail (see notes/gpu_plan.md)")
    fi
    if timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e . >"$STATE/logs/pip_editable.log" 2>&1; then
        notes+=("pip install --no-deps -e . ok")
    else
        notes+=("pip install -e . failed (see logs/pip_editable.log); harness is imported through PYTHONPATH=$REPO")
    fi
    torch_after=$("$PY" -c "import torch; print(torch.__version__)" 2>&1)
    [[ "$torch_before" != "$torch_after" ]] && notes+=("WARNING: torch changed from $torch_before to $torch_after")
    local ds
    ds=$("$PY" -c "import deepspeed; print(deepspeed.__version__)" 2>&1 | tail -1)
    notes+=("torch $torch_after; deepspeed: $ds")
    # DeepSpeed's CPU Adam is a C++ op built on first use (JIT, ~1-2 min): start it now, in the background.
    if command -v nvcc >/dev/null; then export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}; fi
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    echo "export CUDA_HOME=\"${CUDA_HOME:-}\" TORCH_CUDA_ARCH_LIST=\"$TORCH_CUDA_ARCH_LIST\"" >> "$STATE/env.sh"
    rm -f "$STATE/cpu_adam_build.rc"
    ( timeout 420 "$PY" -c "import time; t=time.time(); from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('CPUAdamBuilder loaded in %.0f s' % (time.time()-t))" \
        >"$STATE/logs/cpu_adam_build.log" 2>&1; echo $? >"$STATE/cpu_adam_build.rc" ) &
    CPU_ADAM_PID=$!
    local summary
    summary=$(printf '%s; ' "${notes[@]}")
    "$PY" -c "import json,sys; json.dump({'summary': sys.argv[2]}, open(sys.argv[1],'w'))" "$STATE/setup.json" "$summary"
    echo "setup: $summary"
    touch "$STATE/.setup_done"
}

STAGE_END=0
run_part() {  # run_part NAME MAX_SECONDS: one part as its own process under `timeout`; never stops the suite
    local name=$1 budget=$2 now left rc
    now=$(date +%s); left=$((STAGE_END - now))
    (( budget > left )) && budget=$left
    if (( budget < 20 )); then
        suite --part fail --failed-part "$name" --message "not started: the stage's time budget was used up"
        return 0
    fi
    echo "=== part $name (up to ${budget}s) at $(date -u +%T)"
    timeout --kill-after=20 "$budget" "$PY" benchmarks/gpu_suite.py --state "$STATE" "${DRYFLAG[@]}" --part "$name" --deadline $((now + budget - 10))
    rc=$?
    if (( rc != 0 )); then
        local why="exit $rc"; (( rc == 124 || rc == 137 )) && why="killed at its time limit (${budget}s)"
        suite --part fail --failed-part "$name" --message "$why"
    fi
    report
}

stage_budget() {  # seconds for the next stage
    if [[ -n "${GPU_SUITE_BUDGET_S:-}" ]]; then echo "$GPU_SUITE_BUDGET_S"
    elif [[ ${#STAGES[@]} -eq 1 && "${STAGES[0]}" != all ]]; then echo 570
    else echo 500; fi
}

run_stage() {
    local s=$1 start
    start=$(date +%s)
    if [[ ${#STAGES[@]} -eq 1 && "$s" != all ]]; then STAGE_END=$((T0 + $(stage_budget) - 30))   # the call's own limit
    else STAGE_END=$((start + $(stage_budget) - 30)); fi
    echo "=== $s: until $(date -u -d "@$STAGE_END" +%T 2>/dev/null || echo "$STAGE_END")"
    case "$s" in
        stage1) run_part facts 90; run_part strategies 9999 ;;
        stage2) run_part throughput 330; run_part matrix_compiled 9999 ;;
        stage3) local end=$STAGE_END; STAGE_END=$((end - 40)); run_part matrix_eager 9999; STAGE_END=$end; run_part matrix_table 40 ;;
        rest) local end=$STAGE_END; STAGE_END=$((end - 40))
              run_part facts 60; run_part throughput 9999; run_part matrix_compiled 9999; run_part matrix_eager 9999
              run_part strategies 9999; STAGE_END=$end; run_part matrix_table 40 ;;
    esac
}

setup
for stage in "${STAGES[@]}"; do
    if [[ "$stage" == all ]]; then for s in stage1 stage2 stage3; do run_stage "$s"; done; else run_stage "$stage"; fi
done
if [[ -n "$CPU_ADAM_PID" ]] && kill -0 "$CPU_ADAM_PID" 2>/dev/null; then
    echo "CPU Adam build still running at the end: stopping it"; kill "$CPU_ADAM_PID" 2>/dev/null
fi
report
tar czf "$OUT/logs.tar.gz" -C "$STATE" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude='*.pickle' \
    --exclude='*.npy' --exclude='checkpoints' --exclude='cache' --exclude='models' --exclude='site' \
    logs runs matrix results.json setup.json 2>/dev/null
if [[ $(stat -c %s "$OUT/logs.tar.gz" 2>/dev/null || echo 0) -gt 15000000 ]]; then   # the device tool returns files <= 16 MiB
    tar czf "$OUT/logs.tar.gz" -C "$STATE" --exclude='*.png' --exclude='*.safetensors' --exclude='*.npy' --exclude='cache' \
        --exclude='models' --exclude='site' logs results.json 2>/dev/null
fi
echo "=== done in $(( $(date +%s) - T0 ))s: $OUT/gpu.md $OUT/results.json $OUT/logs.tar.gz"
ls -la "$OUT"
