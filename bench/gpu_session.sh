#!/usr/bin/env bash
# The GPU checks, as one prepared run on a lent GPU machine (which has python3 with torch, and no network):
#   here:  make gpu-kit            # wheels of bench/gpu_requirements.txt for the machine's Python, in .gpu-kit/
#   there: bash bench/gpu_session.sh   with .gpu-kit carried; results in $OUT (at most 8 files)
# It runs, in order: nvidia-smi; the NVML adapter on the real GPU (make gpu-check, JSON); the KV agent's CUDA tests;
# bench.checkpoint with CUDA tensors, quick then full (each bounded; with the agent's device-to-host and
# host-to-device copy rates beside torch's own); bench.resume on the GPU (a drained conversation's next token from
# its checkpoint against a re-prefill and against the disk's floor, bounded); the vLLM connector (bench.vllm_session: a
# conversation saved by one vLLM process continues in a second, compared token for token with a reference run) when
# vLLM is importable there or its wheels were carried in .gpu-kit/vllm (make gpu-kit GPU_KIT_VLLM=1), else it is
# recorded as skipped in vllm-session.log. A step that fails is recorded and the rest still run; the exit status
# is 1 if any failed. $OUT ends with at most 8 files (the device tool returns 8).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
VENV=${GPU_VENV:-/tmp/gpuwarden-venv}
FULL_BENCH_S=${FULL_BENCH_S:-300}
RESUME_S=${RESUME_S:-240}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
failed=()

step() {  # step NAME LOGFILE COMMAND...
    local name=$1 logfile=$2
    shift 2
    echo "== $name" | tee -a "$OUT/session.log"
    local started=$SECONDS
    if "$@" >>"$OUT/$logfile" 2>&1; then
        echo "   ok in $((SECONDS - started)) s" | tee -a "$OUT/session.log"
    else
        echo "   FAILED (exit $?) in $((SECONDS - started)) s; see $logfile" | tee -a "$OUT/session.log"
        failed+=("$name")
    fi
    tail -n 25 "$OUT/$logfile"
}

[ -d .gpu-kit/wheels ] || { echo "no .gpu-kit/wheels: run 'make gpu-kit' here and carry .gpu-kit" >&2; exit 2; }
step "install (offline, from .gpu-kit)" install.log bash -c \
    "$PY -m venv --system-site-packages '$VENV' && '$VENV/bin/python' -m pip install --no-index \
     --find-links .gpu-kit/wheels -r bench/gpu_requirements.txt"
[ ${#failed[@]} -eq 0 ] && rm -f "$OUT/install.log"  # at most 8 files come back from $OUT
PYBIN=$VENV/bin/python
step "nvidia-smi" nvidia-smi.txt nvidia-smi
step "gpu-check (NVML adapter on the real GPU)" gpu-check.json "$PYBIN" -m tools.gpu_check --json
step "KV agent tests with CUDA tensors" pytest.log "$PYBIN" -m pytest -q -p no:cacheprovider -rs \
    tests/test_kv_torch.py tests/test_kv_agent.py
step "bench.checkpoint --device cuda --quick" bench.log "$PYBIN" -m bench.checkpoint --device cuda \
    --quick --out /tmp/gpuwarden-checkpoint-cuda-quick.json  # its table is in bench.log: $OUT holds 8 files
step "bench.checkpoint --device cuda (full, at most ${FULL_BENCH_S}s)" bench.log timeout "$FULL_BENCH_S" \
    "$PYBIN" -m bench.checkpoint --device cuda --out "$OUT/checkpoint-cuda.json"
step "bench.resume --device cuda (at most ${RESUME_S}s)" bench.log timeout "$RESUME_S" \
    "$PYBIN" -m bench.resume --device cuda --out "$OUT/resume-cuda.json"
VLLM_S=${VLLM_S:-900}
if [ -d .gpu-kit/vllm ]; then
    step "install vLLM (offline, from .gpu-kit/vllm)" vllm-session.log "$PYBIN" -m pip install --no-index \
        --find-links .gpu-kit/vllm -r bench/gpu_vllm_requirements.txt
fi
if "$PYBIN" -c "import vllm" >/dev/null 2>&1; then
    step "vLLM connector: save on one server, restore on another (at most ${VLLM_S}s)" vllm-session.log \
        timeout "$VLLM_S" "$PYBIN" -m bench.vllm_session --out /tmp/gpuwarden-vllm/vllm-session.json \
        --work /tmp/gpuwarden-vllm  # the results JSON ends the log: $OUT holds at most 8 files
else
    echo "== vLLM connector: SKIPPED (vLLM is not installed and .gpu-kit/vllm was not carried)" | tee -a "$OUT/session.log"
    printf '{"ok": false, "skipped": "vLLM not installed on the GPU machine; see bench/gpu_vllm_requirements.txt"}\n' \
        >"$OUT/vllm-session.log"
fi
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}" | tee -a "$OUT/session.log"
    exit 1
fi
echo "all GPU checks passed" | tee -a "$OUT/session.log"
