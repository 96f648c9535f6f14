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

# The allocation's host names, one per line. Uses scontrol when it works (it needs the
# cluster's configuration: a machine with SLURM's clients but no slurm.conf has none);
# otherwise expands simple SLURM node lists such as "gpu-[001-003,007],login1" itself.
expand_nodes() {
  local nodelist="$1" hosts
  if command -v scontrol >/dev/null 2>&1 && hosts="$(scontrol show hostnames "$nodelist" 2>/dev/null)" \
    && [[ -n "$hosts" ]]; then
    printf '%s\n' "$hosts"
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

# SRUN=(srun on one node ... "$@"), its output to the file LOG ("-": to srun's own output),
# inside the container when CONTAINER_IMAGE is set (pyxis), in REPO_DIR (which the
# container mounts, with MODEL_DIR, DATA_DIR and OUTPUT_DIR where they are set, or
# CONTAINER_MOUNTS instead of all four; and RAY_TEMP_MOUNT, when set, in any case).
# RAY_TEMP_MOUNT: Ray's temp dir, a host folder on each node that train.sbatch has made
# there: every step of a job gets a container of its own, with a /tmp of its own, and the
# raylet's sockets must be reachable from the steps of its `ray start`, of the wait for
# the cluster and of the trainer alike.
# shellcheck disable=SC2034  # SRUN is read by the sourcing script
srun_on() {
  local node="$1" log="$2"
  shift 2
  local container=() output=() mounts folder
  if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    # The repository is mounted at the same absolute path and is the working directory.
    mounts="$REPO_DIR"
    for folder in "${MODEL_DIR:-}" "${DATA_DIR:-}" "${OUTPUT_DIR:-}"; do
      if [[ -n "$folder" ]]; then mounts+=",$folder"; fi
    done
    mounts="${CONTAINER_MOUNTS:-$mounts}"
    if [[ -n "${RAY_TEMP_MOUNT:-}" ]]; then mounts+=",$RAY_TEMP_MOUNT"; fi
    container=(--container-image="$CONTAINER_IMAGE" --container-mounts="$mounts" --container-workdir="$REPO_DIR")
  fi
  if [[ "$log" != - ]]; then
    output=(--output="$log")
  fi
  SRUN=(srun --nodes=1 --ntasks=1 --overlap -w "$node" ${output[@]+"${output[@]}"} ${container[@]+"${container[@]}"} "$@")
}

# The exit status of background process $1, however many trapped signals interrupt the
# wait (bash runs a trap only between commands, and `wait` returns early for one).
wait_for() {
  local pid="$1"
  while kill -0 "$pid" 2>/dev/null; do
    wait "$pid" 2>/dev/null || true
  done
  wait "$pid" 2>/dev/null
}

# RECIPE_INFO (name -> value) and RECIPE_TRAIN_FILES / RECIPE_VAL_FILES: the recipe $2
# with the overrides that follow, resolved by read_recipe.py on node $1 (inside the
# container, if any: the package must be there); under DRY_RUN on this machine (the
# command is printed too). Also checks that `dapo-megatron`, `ray` and the package are
# there: exits 2 naming what is missing. $SCRIPT_NAME names the script in messages.
# shellcheck disable=SC2034  # the RECIPE_* variables are read by the sourcing script
read_recipe() {
  local node="$1" out status=0 line key value where
  shift
  srun_on "$node" - python3 "$REPO_DIR/examples/qwen2_5_32b/read_recipe.py" "$@"
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    run "${SRUN[@]}"
    out="$(python3 "$REPO_DIR/examples/qwen2_5_32b/read_recipe.py" "$@")" || status=$?
    where="this machine (DRY_RUN reads the recipe here)"
  else
    out="$("${SRUN[@]}")" || status=$?
    where="node $node"
  fi
  if [[ -n "${CONTAINER_IMAGE:-}" && "${DRY_RUN:-0}" != "1" ]]; then
    where+=" in CONTAINER_IMAGE=$CONTAINER_IMAGE"
  fi
  if (( status == 3 )); then
    echo "${SCRIPT_NAME}: what the job runs is missing on $where (above). Activate the virtualenv that has" \
      "dapo-megatron before sbatch (sbatch passes your environment on: --export=ALL), install the package there" \
      "(pip install -e '.[gpu]'), or set CONTAINER_IMAGE to an image that has it" >&2
    exit 2
  elif (( status != 0 )); then
    echo "${SCRIPT_NAME}: cannot read the recipe $1 on $where (exit $status, above: the recipe with the job's" \
      "overrides is refused, or there is no python3 there)" >&2
    exit 2
  fi
  declare -gA RECIPE_INFO=()
  RECIPE_TRAIN_FILES=()
  RECIPE_VAL_FILES=()
  while IFS= read -r line; do
    key="${line%%=*}"
    value="${line#*=}"
    case "$key" in
      train_file) RECIPE_TRAIN_FILES+=("$value") ;;
      val_file) RECIPE_VAL_FILES+=("$value") ;;
      *) RECIPE_INFO["$key"]="$value" ;;
    esac
  done <<<"$out"
}
