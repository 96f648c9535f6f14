#!/usr/bin/env bash
# Helpers shared by train.sbatch and convert.sbatch (sourced, not run).
# Settings come from the environment; DRY_RUN=1 prints each command instead of running it.

# Print a command (shell-quoted) under DRY_RUN=1, else run it.
run() {
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '+'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# Like run, but in the background; the PID goes to LAST_PID (0 under DRY_RUN).
# shellcheck disable=SC2034  # LAST_PID is read by the sourcing script
run_bg() {
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    run "$@"
    LAST_PID=0
  else
    "$@" &
    LAST_PID=$!
  fi
}

# The allocation's host names, one per line. Uses scontrol when present; otherwise
# expands simple SLURM node lists such as "gpu-[001-003,007],login1" itself.
expand_nodes() {
  local nodelist="$1"
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$nodelist"
    return
  fi
  python3 - "$nodelist" <<'PY'
import re, sys
out = []
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", sys.argv[1]):
    m = re.fullmatch(r"(.*)\[(.*)\]", part)
    if not m:
        out.append(part)
        continue
    prefix, ranges = m.groups()
    for r in ranges.split(","):
        lo, _, hi = r.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            out.append(f"{prefix}{i:0{len(lo)}d}")
print("\n".join(out))
PY
}

# This attempt's log folder, $OUTPUT_DIR/logs/<job>/attempt-<n>: a requeued job keeps its
# job id (SLURM_RESTART_COUNT counts its restarts) and srun truncates its --output files,
# so each attempt writes into a folder of its own and the earlier attempts' logs stay.
job_log_dir() {
  printf '%s/logs/%s/attempt-%s\n' "$OUTPUT_DIR" "${SLURM_JOB_ID:-local}" "${SLURM_RESTART_COUNT:-0}"
}

# SRUN=(srun on one node ... "$@"), inside the container when CONTAINER_IMAGE is set (pyxis),
# in REPO_DIR (which the container mounts).
# shellcheck disable=SC2034  # SRUN is read by the sourcing script
srun_on() {
  local node="$1" log="$2"
  shift 2
  local container=()
  if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    # The repository is mounted at the same absolute path and is the working directory.
    container=(--container-image="$CONTAINER_IMAGE" --container-mounts="${CONTAINER_MOUNTS:-$REPO_DIR,$MODEL_DIR,$DATA_DIR,$OUTPUT_DIR}"
      --container-workdir="$REPO_DIR")
  fi
  SRUN=(srun --nodes=1 --ntasks=1 --overlap -w "$node" --output="$log" "${container[@]}" "$@")
}
