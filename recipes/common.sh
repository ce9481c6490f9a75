# Shared by the Inferentia2 recipes (recipes/inf2-*/run.sh), sourced once each has set ARTIFACTS, TP and its
# steps: the project's Neuron image, the checkpoint, the arguments every container runs with, and the step
# that serves an artifact. NOT RUN ON NEURON: see each recipe's README.md.

# The Neuron SDK (docs/neuron.md, "Which Neuron SDK"): 2.31.1, the last with torch-neuronx and NxD for
# inf2 and the line that keeps their fixes; NEURON_SDK=2.28.0 for the reader's NKI kernels (nki 0.2.x,
# the last NKI with inf2). Compile and serve an artifact on the same SDK: the image is built on it.
NEURON_SDK=${NEURON_SDK:-2.31.1}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the default SDK's image is neuron-moe:neuron (as README builds it); another SDK's gets its own tag
if [ "$NEURON_SDK" = 2.31.1 ]; then IMAGE=${IMAGE:-neuron-moe:neuron}; else IMAGE=${IMAGE:-neuron-moe:neuron-sdk$NEURON_SDK}; fi
CHECKPOINT=${CHECKPOINT:-google/gemma-4-26B-A4B-it}
HF_CACHE=${HF_HOME:-$HOME/.cache/huggingface}
MODEL=${MODEL:-gemma4-26b-a4b}
PORT=${PORT:-8080}
NAME=${NAME:-neuron-moe-serve}  # the serving container
mkdir -p "$ARTIFACTS" "$HF_CACHE"

# One --device per chip there is (none on a compile host). The image runs as this user, with the devices'
# group, so that what it writes under ARTIFACTS and the cache is this user's.
DEVICES=()
for dev in /dev/neuron*; do DEVICES+=(--device "$dev"); done
RUN_AS=(--user "$(id -u):$(id -g)" -e HOME=/tmp)
if [ ${#DEVICES[@]} -gt 0 ]; then RUN_AS+=(--group-add "$(stat -c %g /dev/neuron0)"); fi
MOUNTS=(-v "$ARTIFACTS":/artifacts -v "$HF_CACHE":/hf -e HF_HOME=/hf)
if [ -n "${HF_TOKEN:-}" ]; then MOUNTS+=(-e HF_TOKEN); fi
if [ -d "$CHECKPOINT" ]; then
  MOUNTS+=(-v "$(cd "$CHECKPOINT" && pwd)":/checkpoint:ro)
  CKPT=/checkpoint
else
  CKPT=$CHECKPOINT
fi

# Before a compile (hours): the host's memory against neuronx-cc's for the build's largest key, the
# GiB of `neuron-moe plan`'s "compile host" line (a stated estimate from the graph's size, not a
# measurement: docs/neuron.md), which each recipe names; the host's memory is read from MEMINFO
# (/proc/meminfo). FORCE_COMPILE=1 compiles on a smaller host anyway.
check_compile_host() {  # $1: the plan's figure, GiB, rounded up
  local have
  have=$(awk '/^MemTotal:/ { print int($2 / 1048576) }' "${MEMINFO:-/proc/meminfo}")
  if [ "${have:-0}" -lt "$1" ] && [ -z "${FORCE_COMPILE:-}" ]; then
    echo "this host has ${have:-no known} GiB of memory; neuron-moe plan estimates neuronx-cc needs at least $1 GiB" \
      "for the largest key (its 'compile host' line: an estimate, not a measurement): compile on a larger host," \
      "or FORCE_COMPILE=1 to try anyway" >&2
    exit 2
  fi
}

build_image() {
  docker build -f "$REPO/docker/Dockerfile.neuron" --build-arg NEURON_SDK="$NEURON_SDK" -t "$IMAGE" "$REPO"
}

serve() {  # the artifact $1 (under ARTIFACTS) alone: it carries its tokenizer; then one request
  docker rm -f "$NAME" > /dev/null 2>&1 || true  # a server left by an earlier run
  docker run -d --rm --name "$NAME" "${DEVICES[@]}" "${RUN_AS[@]}" -e NEURON_RT_NUM_CORES="$TP" \
    -v "$ARTIFACTS":/artifacts:ro -p "$PORT":8080 \
    "$IMAGE" --model "$MODEL" --backend neuron --artifacts "/artifacts/$1" > /dev/null
  local log=$ARTIFACTS/$NAME.log
  docker logs -f "$NAME" > "$log" 2>&1 &  # kept after the container is gone (--rm)
  echo "waiting for $NAME to load and warm up (minutes); its log: $log"
  until curl -sf "http://127.0.0.1:$PORT/ping" > /dev/null; do
    if [ -z "$(docker ps -q --filter "name=^$NAME\$")" ]; then
      sleep 1  # the log follower's last lines
      echo "$NAME exited before it was ready:" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
    sleep 10
  done
  curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
  echo
  echo "serving on http://127.0.0.1:$PORT (docker stop $NAME stops it)"
}
