#!/usr/bin/env bash
# The one prepared check for a machine with a CUDA GPU and PyTorch already installed.
#
#   scripts/gpu_check.sh OUT_DIR [WHEELS_DIR]
#
# Installs only the project itself (no dependency downloads; packages missing there, such as
# pycocotools or jsonschema, come from WHEELS_DIR when given), then runs the environment
# check, the benchmark matrix for cuda and cpu (train and infer, every precision, tiny_conv
# and resnet18), a short training run, evaluation and profiling, then two checks of timing
# code (DeviceTimer on the last visible GPU, profiler shares against torch's own table total).
# Every JSON and the log go to OUT_DIR. DEVICE=cpu runs the same steps without a GPU and
# without those two checks (to check the script itself).
# Budget: under 6 minutes on an H200 machine. scripts/gpu_wheels.sh fetches WHEELS_DIR.
set -euo pipefail

out=${1:?usage: scripts/gpu_check.sh OUT_DIR [WHEELS_DIR]}
wheels=${2:-}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
epochs=${EPOCHS:-5}
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee "$out/gpu_check.log") 2>&1
started=$(date +%s)
step() { printf '\n== %s (%ss)\n' "$1" "$(($(date +%s) - started))"; }

step "install (no network)"
site=$(mktemp -d)
if [ -n "$wheels" ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
fi
if ! "$python" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" . 2>/dev/null; then
  echo "pip could not build the project offline: using it from src/ directly"
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
run() { "$python" -m pipeline --log "$out/$1.log" "${@:2}"; }

step "environment"
run check_env check-env --output "$out/env.json"
if [ "$device" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
fi

step "benchmarks"
backends=cpu
[ "$device" = cuda ] && backends="cuda cpu"
for backend in $backends; do
  budget=3
  [ "$backend" = cpu ] && budget=${CPU_BUDGET:-2}
  for precision in fp32 fp16 bf16; do
    for mode in train infer; do
      run "bench-$backend-$precision-$mode" bench --device "$backend" --precision "$precision" --mode "$mode" \
        --model tiny_conv,resnet18 --batch-size 16 --image-size 128 --warmup 3 --steps 30 \
        --time-budget "$budget" --out "$out/bench-$backend-$precision-$mode.json"
    done
  done
done

step "data"
data=$(mktemp -d)/shapes
run prepare_data prepare-data --out "$data"

step "train ($device, $epochs epochs)"
run train train --out "$out/train" device="$device" data.root="$data" train.epochs="$epochs" train.val_interval="$epochs"
cp "$out/train/train_summary.json" "$out/train_summary.json"
cp "$out/train/metrics.jsonl" "$out/metrics.jsonl"

step "evaluate"
run eval eval --checkpoint "$out/train/best.pth" --device "$device" --out "$out/eval.json"

step "profile"
run profile profile --checkpoint "$out/train/best.pth" --device "$device" --batch-sizes 1,8,32,128 --out "$out/profile"
cp "$out/profile/profile.json" "$out/profile.json"
rm -f "$out/train/"*.pth "$out/profile/trace.json"

if [ "$device" = cuda ]; then
  step "device timer on the last GPU, profiler shares"
  # DeviceTimer must read the timed device's own stream (not cuda:0's) and the kernel rows'
  # shares must add up to 1 against torch's own "Self CUDA time total".
  "$python" - "$out/device_checks.json" <<'PY'
import json, re, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from pipeline import device as dev, profiling
from pipeline.models import build_model

device = torch.device("cuda", torch.cuda.device_count() - 1)
x = torch.randn(4096, 4096, device=device)
for _ in range(3):
    x @ x
dev.synchronize(device)
timer = dev.DeviceTimer(device)
start = time.perf_counter()
timer.start()
for _ in range(20):
    x @ x
event_ms = timer.stop_ms()
wall_ms = (time.perf_counter() - start) * 1000

model = build_model("tiny_conv", 4, "single").to(device).eval()
images = torch.randint(0, 256, (8, 3, 128, 128), dtype=torch.uint8, device=device)
with torch.inference_mode():
    model(images)
    dev.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(images)
        dev.synchronize(device)
events = prof.key_averages()
rows = profiling.operator_rows(events, "self_device_ms")
kernel_ms = sum(row["self_device_ms"] for row in rows if row["kind"] == "kernel")
total = re.search(r"Self CUDA time total: ([0-9.]+)(us|ms|s)", events.table())
scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
torch_total_ms = float(total.group(1)) * scale[total.group(2)] if total else None
result = {
    "device": str(device),
    "devices_visible": torch.cuda.device_count(),
    "timer_event_ms": event_ms,
    "timer_wall_ms": wall_ms,
    "timer_ok": event_ms is not None and event_ms > 0.5 * wall_ms,
    "kernel_share_sum": sum(row["share"] for row in rows if row["kind"] == "kernel"),
    "operator_share_sum": sum(row["share"] for row in rows if row["kind"] == "operator"),
    "kernel_self_device_ms": kernel_ms,
    "torch_table_self_cuda_total_ms": torch_total_ms,
    "shares_ok": torch_total_ms is not None and abs(kernel_ms - torch_total_ms) <= 0.01 * torch_total_ms + 0.01,
}
json.dump(result, open(sys.argv[1], "w"), indent=2)
print(json.dumps(result, indent=2))
PY
fi

step "done"
echo "everything is in $out"
