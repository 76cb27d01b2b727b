# shellcheck shell=bash
# slurm/lib/grpo_common.sh - the one launcher behind slurm/grpo_*.sh. Sourced, then `grpo_main "$@"`.
#
# What a job does (the batch script runs on the allocation's first node):
#   1. reads the recipe (+ command-line overrides) with the project's own config loader, so
#      engine type, SGLang TP size / engine count / ports / router and weight-sync mode come from
#      the recipe; a bad recipe fails here, before any server starts;
#   2. plans the placement: trainer nodes and tasks, and which node/GPUs/port each SGLang engine
#      gets (ENGINE_PLACEMENT, below);
#   3. makes the job's engine API key (GRPO_SGLANG_API_KEY, random, exported to every step, never on
#      a command line: launch/api_key_exec.py hands it to SGLang's and the router's --api-key);
#   4. runs `megatron-grpo doctor` on every node (one srun task each): the recipe's needs against
#      each node (packages, GPUs, model and data readable, output writable with room for a
#      checkpoint, ports free, network interfaces); stops with the nodes' blocker lines; then
#      starts one `srun` step per engine (python -m sglang.launch_server), waits until each answers
#      GET /health_generate (it generated a token), then the router (python -m
#      sglang_router.launch_router) on the batch node, ready on GET /readiness (its /health is 200
#      even with no live worker);
#   5. starts the trainer with ONE srun TASK PER GPU (python -m megatron_grpo.train RECIPE
#      logging.output_dir=RUN_DIR rollout.sglang.urls=[...] rollout.sglang.api_key_env=GRPO_SGLANG_API_KEY
#      "$@"), waits for it;
#   6. on exit, USR1 (`--signal=B:USR1@120`: time limit / preemption notice) or TERM: forwards
#      the signal to the trainer (which checkpoints and stops), stops every server it started by
#      pid (TERM, then KILL after SERVER_STOP_GRACE_S), and, with GRPO_RESUBMIT=1, submits the
#      same script again with the same arguments and run folder (the trainer resumes with
#      checkpoint.resume=auto).
#
# Why one srun task per GPU (and not torchrun per node): every rank is a Slurm task, so Slurm
# delivers signals to each, reports per-task exit codes and kills the whole step when one rank
# fails (--kill-on-bad-exit); rank discovery is SLURM_PROCID/SLURM_LOCALID (launch/env.py), the
# same program runs under mpirun. Each task sees ALL GPUs of its node and picks GPU = local rank:
# CUDA IPC between trainer and colocated SGLang engines (weight_sync=tensor) and NVLink P2P need
# the same device numbering in every process, which per-task GPU isolation (--gpus-per-task=1)
# would break.
#
# Environment (all optional; the top-level scripts document the model-specific defaults):
#   RECIPE               recipe name or file                                   [set by each script]
#   HF_MODEL             HF model folder -> model.path (trainer) and --model-path (SGLang) [recipe]
#   TRAIN_FILES / VAL_FILES  comma-separated data files -> data.train_files / data.val_files [recipe]
#   OUTPUT_ROOT          parent of run folders                    [$SLURM_SUBMIT_DIR/outputs]
#   GRPO_RUN_DIR         the run folder itself      [$OUTPUT_ROOT/<job name>-<job id>]
#   GRPO_PYTHON          python with megatron-grpo installed (also for SGLang) [python on PATH]
#   GPUS_PER_NODE        GPUs per node              [from Slurm: SLURM_GPUS_ON_NODE]
#   TASKS_PER_NODE       trainer tasks per node     [GPUS_PER_NODE; CPU jobs: SLURM_NTASKS_PER_NODE]
#   ENGINE_PLACEMENT     auto | colocated | dedicated | none                              [auto]
#                        auto: none for rollout.engine=local or when rollout.sglang.urls is set,
#                        colocated for weight_sync=tensor (engines share the trainer GPUs, started
#                        with --enable-memory-saver), dedicated otherwise (engines on the LAST
#                        ceil(num_engines*tp_size/GPUS_PER_NODE) nodes, trainer on the others)
#   SGLANG_MODEL_PATH    model the engines load                         [HF_MODEL / model.path]
#   SGLANG_MODULE        server module              [sglang.launch_server]
#   SGLANG_ROUTER_MODULE router module              [sglang_router.launch_router]
#   SGLANG_EXTRA_ARGS    extra server flags (word-split), after rollout.sglang.extra_args  []
#   SGLANG_PORT          first port on each node; engine j of a node: +j*SGLANG_PORT_STRIDE
#                        (SGLang takes a few ports above its own)        [rollout.sglang.port]
#   SGLANG_PORT_STRIDE   [10]
#   SGLANG_BIND_HOST     address the servers bind   [the node's name, so other nodes reach them]
#   GRPO_SGLANG_API_KEY  the key engines and router answer to            [random, per job]
#   SGLANG_STARTUP_TIMEOUT_S  health wait           [rollout.sglang.startup_timeout_s]
#   ENGINE_CPUS          CPUs of each engine step   [SLURM_CPUS_ON_NODE / engines per node, >= 1]
#   GRPO_NET_IFNAME      NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (e.g. ib0, eth0)
#                        [the interface that routes to the first trainer node]
#   GRPO_RESUBMIT        1: resubmit after a USR1/TERM stop [0];  GRPO_MAX_RESUBMITS [5]
#   GRPO_MAX_RESTARTS    restarts of the trainer step after a failure (a rank died or hung), in a row
#                        without a newer checkpoint; 0: none (grpo_run_trainer)              [3]
#   GRPO_SBATCH_ARGS     extra sbatch options for the resubmission (word-split) []
#   TRAINER_STOP_GRACE_S seconds the trainer gets after a forwarded signal [100]
#   SERVER_STOP_GRACE_S  seconds servers get between TERM and KILL [20]
#   DRY_RUN              1: print the plan and the exact command of every node; start nothing.
#                        Works inside an allocation (DRY_RUN=1 sbatch ...) and outside one
#                        (DRY_RUN=1 bash slurm/X.sh: nodes from DRY_RUN_NODELIST or node1..N)

GRPO_KEYED=megatron_grpo.launch.api_key_exec  # runs a module with --api-key from the environment
GRPO_PIDS=()        # every process this script started (srun clients, router)
GRPO_PID_NAMES=()
GRPO_TRAINER_PID=""
GRPO_SIGNAL=""      # USR1 / TERM when the job was asked to stop
GRPO_ARGS=()
# reward.models' SGLang servers this job starts (grpo_read_reward_models), one entry per server
GRPO_RM_NAME=(); GRPO_RM_MODEL=(); GRPO_RM_TP=(); GRPO_RM_GPU=(); GRPO_RM_PORT=(); GRPO_RM_MEM=(); GRPO_RM_FLAGS=()

grpo_log() { printf '[grpo %(%H:%M:%S)T] %s\n' -1 "$*"; [ -z "${GRPO_LOG_FILE:-}" ] || printf '[grpo %(%H:%M:%S)T] %s\n' -1 "$*" >> "$GRPO_LOG_FILE"; }
grpo_die() { grpo_log "ERROR: $*" >&2; exit 1; }
grpo_quote() { local out; printf -v out '%q ' "$@"; printf '%s' "${out% }"; }

# ------------------------------------------------------------------------------ allocation
grpo_allocation() {
    local list
    GRPO_IN_SLURM=0; [ -n "${SLURM_JOB_ID:-}" ] && GRPO_IN_SLURM=1
    if [ "$GRPO_IN_SLURM" = 1 ]; then
        list=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || grpo_die "scontrol show hostnames '$SLURM_JOB_NODELIST' failed"
        mapfile -t GRPO_NODES <<< "$list"
        local g=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
        GPUS_PER_NODE=${GPUS_PER_NODE:-${g##*:}}
    elif [ "${DRY_RUN:-0}" = 1 ]; then
        if [ -n "${DRY_RUN_NODELIST:-}" ]; then
            read -r -a GRPO_NODES <<< "${DRY_RUN_NODELIST//,/ }"
        else
            GRPO_NODES=(); local i
            for ((i = 1; i <= ${GRPO_DEFAULT_NODES:-1}; i++)); do GRPO_NODES+=("node$i"); done
        fi
        GPUS_PER_NODE=${GPUS_PER_NODE:-${GRPO_DEFAULT_GPUS_PER_NODE:-0}}
    else
        grpo_die "not inside a Slurm job: submit with sbatch (or DRY_RUN=1 to print the plan)"
    fi
    [[ $GPUS_PER_NODE =~ ^[0-9]+$ ]] || grpo_die "GPUS_PER_NODE='$GPUS_PER_NODE' is not a number"
    GRPO_NNODES=${#GRPO_NODES[@]}
    GRPO_BATCH_HOST=${GRPO_NODES[0]}
}

# ------------------------------------------------------------------------------ python
# The python the job runs must have the trainer's packages (and SGLang, where this job starts the
# engines): a shell without the environment active finds a system python with neither, and
# `import megatron_grpo` alone would succeed from the repository folder.
grpo_missing_modules() {
    "$GRPO_PYTHON" - "$@" <<'PY'
import importlib.util, sys
def absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # its parent package is missing
        return True
print(" ".join(m for m in sys.argv[1:] if absent(m)))
PY
}

grpo_check_python() {
    local missing
    missing=$(grpo_missing_modules megatron_grpo torch megatron.core yaml 2>&1) || missing="(python failed: $missing)"
    [ -z "$missing" ] || grpo_die "$GRPO_PYTHON lacks $missing: activate the environment where megatron-grpo is" \
        "installed (bash scripts/setup_env.sh) or set GRPO_PYTHON"
}

# After grpo_read_recipe: a job that starts SGLang engines needs SGLang in that python too (a
# warning in DRY_RUN, which starts nothing).
grpo_check_engine_python() {
    [ "$R_ENGINE" = sglang ] && [ "$R_NUM_URLS" = 0 ] || return 0
    local module=${SGLANG_MODULE:-sglang.launch_server} missing message
    missing=$(grpo_missing_modules "${module%%.*}" 2>&1) || missing="(python failed: $missing)"
    [ -n "$missing" ] || return 0
    message="$GRPO_PYTHON lacks $missing, which starts the SGLang engines ($module): install SGLang there, set"
    message+=" GRPO_PYTHON, or give the engines' rollout.sglang.urls"
    if [ "${DRY_RUN:-0}" = 1 ]; then grpo_log "WARNING: $message" >&2; else grpo_die "$message"; fi
}

# ------------------------------------------------------------------------------ recipe
# Reads the values the launcher needs through the project's loader (validated), as shell vars R_*.
grpo_read_recipe() {
    local code
    code=$("$GRPO_PYTHON" - "$RECIPE" "${GRPO_ARGS[@]}" <<'PY'
import shlex, sys
from megatron_grpo.config import load_config, validate
from megatron_grpo.errors import MegatronGRPOError
try:
    c = load_config(sys.argv[1], sys.argv[2:])
    validate(c)
except MegatronGRPOError as exc:
    print(f"grpo_die {shlex.quote(f'recipe {sys.argv[1]}: {exc}')}")
    sys.exit(0)
s = c.rollout.sglang
values = dict(R_ENGINE=c.rollout.engine, R_MODEL_PATH=c.model.path or "", R_TP=s.tp_size,
              R_NUM_ENGINES=s.num_engines, R_MEM_FRACTION=s.mem_fraction, R_PORT=s.port,
              R_ROUTER=int(s.router), R_ROUTER_PORT=s.router_port, R_ROUTER_POLICY=s.router_policy,
              R_WEIGHT_SYNC=s.weight_sync, R_STARTUP_TIMEOUT=int(s.startup_timeout_s),
              R_DETERMINISTIC=int(s.deterministic_inference), R_FP32_LM_HEAD=int(c.model.fp32_lm_head),
              R_NUM_URLS=len(s.urls), R_SAVE_DIR=c.checkpoint.save_dir or "",
              R_MODEL_PARALLEL=c.parallel.tensor * c.parallel.pipeline * c.parallel.context)
for key, value in values.items():
    print(f"{key}={shlex.quote(str(value))}")
print("R_EXTRA_ARGS=(" + " ".join(shlex.quote(a) for a in s.extra_args) + ")")
PY
) || grpo_die "could not read recipe $RECIPE with $GRPO_PYTHON (is megatron-grpo installed there?)"
    eval "$code"
}

# grpo_read_reward_models: the SGLang servers of reward.models this job starts (scorers with
# backend=sglang, sglang.gpus set and no urls, and a non-zero weight): one per sglang.tp_size of
# those GPUs, on the batch node, ports from sglang.port; reward models with --is-embedding (SGLang's
# classification path). The trainer gets their URLs (grpo_engine_overrides) and launches none.
grpo_read_reward_models() {
    local code
    code=$("$GRPO_PYTHON" - "$RECIPE" "${GRPO_ARGS[@]}" <<'PY'
import shlex, sys
from megatron_grpo.config import load_config
c = load_config(sys.argv[1], sys.argv[2:])
rows = []
for name, m in c.reward.models.items():
    s = m.sglang
    if m.backend != "sglang" or s.urls or not s.gpus or not c.reward.combine.active(name):
        continue
    # one --random-seed for all: Qwen2/3 classification heads keep a random bias HF checkpoints lack
    flags = ["--is-embedding", "--random-seed", "0"] if m.kind == "reward_model" else []
    for i in range(len(s.gpus) // s.tp_size):
        rows.append((name, m.path, s.tp_size, s.gpus[i * s.tp_size], s.port + i, s.mem_fraction,
                     shlex.join([*flags, *s.extra_args])))
for column, var in enumerate(("NAME", "MODEL", "TP", "GPU", "PORT", "MEM", "FLAGS")):
    print(f"GRPO_RM_{var}=(" + " ".join(shlex.quote(str(row[column])) for row in rows) + ")")
PY
) || grpo_die "could not read reward.models of recipe $RECIPE with $GRPO_PYTHON"
    eval "$code"
}

# ------------------------------------------------------------------------------ plan
grpo_plan() {
    local G=$GPUS_PER_NODE i
    GRPO_PLACEMENT=${ENGINE_PLACEMENT:-auto}
    if [ "$GRPO_PLACEMENT" = auto ]; then
        if [ "$R_ENGINE" != sglang ] || [ "$R_NUM_URLS" -gt 0 ]; then GRPO_PLACEMENT=none
        elif [ "$R_WEIGHT_SYNC" = tensor ]; then GRPO_PLACEMENT=colocated
        else GRPO_PLACEMENT=dedicated; fi
    fi
    case $GRPO_PLACEMENT in none|colocated|dedicated) ;; *) grpo_die "ENGINE_PLACEMENT=$GRPO_PLACEMENT: expected auto, colocated, dedicated or none";; esac

    if [ "$G" -gt 0 ]; then
        GRPO_TASKS_PER_NODE=${TASKS_PER_NODE:-$G}
    else
        GRPO_TASKS_PER_NODE=${TASKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-$(( ${SLURM_NTASKS:-$GRPO_NNODES} / GRPO_NNODES ))}}
    fi
    [ "$GRPO_TASKS_PER_NODE" -ge 1 ] || grpo_die "no trainer tasks per node (TASKS_PER_NODE=$GRPO_TASKS_PER_NODE)"

    GRPO_ENGINE_NODES=(); GRPO_TRAINER_NODES=("${GRPO_NODES[@]}")
    GRPO_ENGINE_HOST=(); GRPO_ENGINE_GPUS=(); GRPO_ENGINE_PORT=(); GRPO_ENGINE_BASE_GPU=()
    if [ "$GRPO_PLACEMENT" != none ]; then
        local tp=$R_TP n=$R_NUM_ENGINES
        [ "$G" -gt 0 ] || grpo_die "SGLang engines need GPUs, but GPUS_PER_NODE=0 (request --gpus-per-node or set GPUS_PER_NODE)"
        [ $((G % tp)) = 0 ] || grpo_die "rollout.sglang.tp_size=$tp does not divide the $G GPUs of a node (engines spanning nodes are not supported by this launcher)"
        local per_node=$((G / tp)) need_nodes=$(( (n * tp + G - 1) / G ))
        if [ "$GRPO_PLACEMENT" = dedicated ]; then
            [ "$need_nodes" -lt "$GRPO_NNODES" ] || grpo_die "dedicated engines: $n engines x tp $tp need $need_nodes of the $GRPO_NNODES nodes, leaving none for the trainer"
            GRPO_TRAINER_NODES=("${GRPO_NODES[@]:0:GRPO_NNODES-need_nodes}")
            GRPO_ENGINE_NODES=("${GRPO_NODES[@]:GRPO_NNODES-need_nodes}")
        else
            [ "$need_nodes" -le "$GRPO_NNODES" ] || grpo_die "colocated engines: $n engines x tp $tp need $((n * tp)) GPUs, the job has $((GRPO_NNODES * G))"
            # weight_sync=tensor: the trainer rank on each engine GPU feeds it (rollout/sglang/colocated.py)
            [ "$R_WEIGHT_SYNC" != tensor ] || [ "$GRPO_TASKS_PER_NODE" = "$G" ] || grpo_die "colocated engines with weight_sync=tensor need one trainer task per GPU (TASKS_PER_NODE=$GRPO_TASKS_PER_NODE, GPUS_PER_NODE=$G)"
            GRPO_ENGINE_NODES=("${GRPO_NODES[@]:0:need_nodes}")
        fi
        local base_port=${SGLANG_PORT:-$R_PORT} stride=${SGLANG_PORT_STRIDE:-10} k j first gpus
        for ((k = 0; k < n; k++)); do
            j=$((k % per_node)); first=$((j * tp)); gpus=$first
            for ((i = first + 1; i < first + tp; i++)); do gpus+=",$i"; done
            GRPO_ENGINE_HOST+=("${GRPO_ENGINE_NODES[k / per_node]}")
            GRPO_ENGINE_BASE_GPU+=("$first"); GRPO_ENGINE_GPUS+=("$gpus")
            GRPO_ENGINE_PORT+=($((base_port + j * stride)))
        done
    fi
    GRPO_TRAINER_NNODES=${#GRPO_TRAINER_NODES[@]}
    GRPO_WORLD=$((GRPO_TRAINER_NNODES * GRPO_TASKS_PER_NODE))
    [ $((GRPO_WORLD % R_MODEL_PARALLEL)) = 0 ] || grpo_die "$GRPO_WORLD trainer ranks ($GRPO_TRAINER_NNODES nodes x $GRPO_TASKS_PER_NODE) are not divisible by parallel.tensor x pipeline x context = $R_MODEL_PARALLEL"
}

# grpo_check_ports: a server port inside this node's ephemeral range can be taken, before the server
# binds it, by any client socket; srun's own I/O listeners among them (then srun answers the health
# checks with "Insane message length"). A warning: the range may differ on the engine nodes.
grpo_check_ports() {
    local lo hi port
    read -r lo hi 2>/dev/null < /proc/sys/net/ipv4/ip_local_port_range || return 0
    [ "${#GRPO_ENGINE_HOST[@]}" -gt 0 ] || return 0
    for port in "${GRPO_ENGINE_PORT[@]}" "$R_ROUTER_PORT"; do
        if [ "$port" -ge "$lo" ] && [ "$port" -le "$hi" ]; then
            grpo_log "WARNING: server port $port (SGLANG_PORT / rollout.sglang.port, router_port) lies in the ephemeral port range $lo-$hi (net.ipv4.ip_local_port_range), where other sockets may take it first: choose ports below $lo" >&2
            return 0
        fi
    done
}

# ------------------------------------------------------------------------------ commands
grpo_engine_url() { printf 'http://%s:%s' "${SGLANG_BIND_HOST:-${GRPO_ENGINE_HOST[$1]}}" "${GRPO_ENGINE_PORT[$1]}"; }

# grpo_engine_cmd K: sets GRPO_CMD (what runs on the node) and GRPO_LAUNCH (the srun around it)
grpo_engine_cmd() {
    local k=$1 host=${GRPO_ENGINE_HOST[$1]} per_node cpus
    GRPO_CMD=("$GRPO_PYTHON" -m "$GRPO_KEYED" GRPO_SGLANG_API_KEY "${SGLANG_MODULE:-sglang.launch_server}"
        --model-path "${SGLANG_MODEL_PATH:-${HF_MODEL:-$R_MODEL_PATH}}" --tp-size "$R_TP"
        --base-gpu-id "${GRPO_ENGINE_BASE_GPU[$k]}" --host "${SGLANG_BIND_HOST:-$host}" --port "${GRPO_ENGINE_PORT[$k]}"
        --mem-fraction-static "$R_MEM_FRACTION")
    [ "$GRPO_PLACEMENT" = colocated ] && GRPO_CMD+=(--enable-memory-saver)
    # SGLang ignores the trainer's sampling seeds without it (rollout.sglang.deterministic_inference).
    [ "$R_DETERMINISTIC" = 1 ] && GRPO_CMD+=(--enable-deterministic-inference)
    # the LM head in fp32 on both sides (model.fp32_lm_head; the trainer checks /server_info)
    [ "$R_FP32_LM_HEAD" = 1 ] && GRPO_CMD+=(--enable-fp32-lm-head)
    GRPO_CMD+=("${R_EXTRA_ARGS[@]}")
    local extra=(); read -r -a extra <<< "${SGLANG_EXTRA_ARGS:-}"; GRPO_CMD+=("${extra[@]}")
    per_node=$((GPUS_PER_NODE / R_TP))
    cpus=${ENGINE_CPUS:-$(( ${SLURM_CPUS_ON_NODE:-$per_node} / per_node ))}; [ "$cpus" -ge 1 ] || cpus=1
    # --overlap: share the node with the trainer step (colocated) and the other engines; the
    # step gets all the node's GPUs (Slurm's default for steps) and --base-gpu-id picks them.
    GRPO_LAUNCH=(srun --overlap --nodes=1 --ntasks=1 --nodelist="$host" --cpus-per-task="$cpus"
        --cpu-bind=none --job-name="sglang-$k" --open-mode=append --output="$GRPO_LOG_DIR/sglang-$k-$host.log")
}

grpo_router_url() { printf 'http://%s:%s' "${SGLANG_BIND_HOST:-$GRPO_BATCH_HOST}" "$R_ROUTER_PORT"; }

grpo_rm_url() { printf 'http://%s:%s' "${SGLANG_BIND_HOST:-$GRPO_BATCH_HOST}" "${GRPO_RM_PORT[$1]}"; }

# grpo_rm_cmd K: GRPO_CMD / GRPO_LAUNCH of reward-model server K, on the batch node's GPUs from
# reward.models.<name>.sglang.gpus (not trainer GPUs' engines: it stays resident)
grpo_rm_cmd() {
    local k=$1 flags=() gpus i
    eval "flags=(${GRPO_RM_FLAGS[$k]})"
    GRPO_CMD=("$GRPO_PYTHON" -m "$GRPO_KEYED" GRPO_SGLANG_API_KEY "${SGLANG_MODULE:-sglang.launch_server}"
        --model-path "${GRPO_RM_MODEL[$k]}" --tp-size "${GRPO_RM_TP[$k]}" --base-gpu-id "${GRPO_RM_GPU[$k]}"
        --host "${SGLANG_BIND_HOST:-$GRPO_BATCH_HOST}" --port "${GRPO_RM_PORT[$k]}"
        --mem-fraction-static "${GRPO_RM_MEM[$k]}" "${flags[@]}")
    gpus=${GRPO_RM_GPU[$k]}
    for ((i = 1; i < GRPO_RM_TP[k]; i++)); do gpus+=",$((GRPO_RM_GPU[k] + i))"; done
    GRPO_RM_GPUS=$gpus
    GRPO_LAUNCH=(srun --overlap --nodes=1 --ntasks=1 --nodelist="$GRPO_BATCH_HOST" --cpus-per-task="${ENGINE_CPUS:-1}"
        --cpu-bind=none --job-name="rm-$k" --open-mode=append --output="$GRPO_LOG_DIR/rm-$k-$GRPO_BATCH_HOST.log")
}

# grpo_start_reward_models: the reward models' servers, before the engines (SGLang sizes a server by
# the GPU memory free when it starts: the recipes' arithmetic counts the RM first), waited on
grpo_start_reward_models() {
    local k urls=() offset=${#GRPO_PIDS[@]}
    for ((k = 0; k < ${#GRPO_RM_NAME[@]}; k++)); do
        grpo_rm_cmd "$k"
        grpo_start_bg "rm-$k" "$GRPO_LOG_DIR/launch-rm-$k.log" "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}"
        urls+=("$(grpo_rm_url "$k")")
    done
    [ "${#urls[@]}" = 0 ] || grpo_wait_healthy "$offset" /health_generate "${urls[@]}"
}

grpo_router_cmd() {
    local urls=() k
    for ((k = 0; k < ${#GRPO_ENGINE_HOST[@]}; k++)); do urls+=("$(grpo_engine_url "$k")"); done
    GRPO_ROUTER_URL=$(grpo_router_url)
    GRPO_CMD=("$GRPO_PYTHON" -m "$GRPO_KEYED" GRPO_SGLANG_API_KEY "${SGLANG_ROUTER_MODULE:-sglang_router.launch_router}" --host "${SGLANG_BIND_HOST:-$GRPO_BATCH_HOST}"
        --port "$R_ROUTER_PORT" --policy "$R_ROUTER_POLICY" --worker-urls "${urls[@]}")
}

# grpo_engine_overrides: GRPO_ENGINE_OVERRIDES, the engine URLs (in placement order) and the
# router's URL for the trainer (and for the recipe check before anything starts)
grpo_engine_overrides() {
    local k url_list=""
    GRPO_ENGINE_OVERRIDES=()
    if [ "${#GRPO_ENGINE_HOST[@]}" -gt 0 ]; then
        for ((k = 0; k < ${#GRPO_ENGINE_HOST[@]}; k++)); do url_list+="${url_list:+,}\"$(grpo_engine_url "$k")\""; done
        GRPO_ENGINE_OVERRIDES+=("rollout.sglang.urls=[$url_list]" "rollout.sglang.api_key_env=GRPO_SGLANG_API_KEY")
        [ "$R_ROUTER" = 1 ] && GRPO_ENGINE_OVERRIDES+=("rollout.sglang.router_url=$(grpo_router_url)")
    fi
    local name
    for name in $(printf '%s\n' "${GRPO_RM_NAME[@]}" | sort -u); do  # each scorer: its servers, in order
        url_list=""
        for ((k = 0; k < ${#GRPO_RM_NAME[@]}; k++)); do
            [ "${GRPO_RM_NAME[$k]}" = "$name" ] && url_list+="${url_list:+,}\"$(grpo_rm_url "$k")\""
        done
        GRPO_ENGINE_OVERRIDES+=("reward.models.$name.sglang.urls=[$url_list]" "reward.models.$name.sglang.gpus=[]"
            "reward.models.$name.sglang.api_key_env=GRPO_SGLANG_API_KEY")
    done
    return 0
}

grpo_trainer_cmd() {
    local overrides=("logging.output_dir=$GRPO_RUN_DIR")
    grpo_engine_overrides
    overrides+=("${GRPO_ENGINE_OVERRIDES[@]}")
    GRPO_CMD=("$GRPO_PYTHON" -m megatron_grpo.train "$RECIPE" "${overrides[@]}" "${GRPO_ARGS[@]}")
    local nodelist; nodelist=$(IFS=,; echo "${GRPO_TRAINER_NODES[*]}")
    GRPO_LAUNCH=(srun --nodes="$GRPO_TRAINER_NNODES" --ntasks-per-node="$GRPO_TASKS_PER_NODE"
        --ntasks="$GRPO_WORLD" --nodelist="$nodelist" --kill-on-bad-exit=1 --job-name=trainer
        --open-mode=append --output="$GRPO_LOG_DIR/trainer-%t.log")  # append: resubmissions share the run folder
    [ "$GRPO_PLACEMENT" = colocated ] && GRPO_LAUNCH+=(--overlap)
    [ -n "${SLURM_CPUS_PER_TASK:-}" ] && GRPO_LAUNCH+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    return 0
}

# ------------------------------------------------------------------------------ env
grpo_network_env() {
    local ifname=${GRPO_NET_IFNAME:-} addr
    if [ -z "$ifname" ] && command -v ip >/dev/null; then
        addr=$(getent ahostsv4 "${GRPO_TRAINER_NODES[0]}" 2>/dev/null | awk 'NR == 1 {print $1}')
        [ -n "$addr" ] && ifname=$(ip -o route get "$addr" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p')
    fi
    if [ -n "$ifname" ]; then
        export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ifname} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname}
    fi
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export PYTHONUNBUFFERED=1
}

# ------------------------------------------------------------------------------ doctor, key
# grpo_doctor_cmd: `megatron-grpo doctor` once on every node, with the job's layout and ports
grpo_doctor_cmd() {
    local ports=() port
    if [ "${#GRPO_ENGINE_HOST[@]}" -gt 0 ]; then
        for port in $(printf '%s\n' "${GRPO_ENGINE_PORT[@]}" | sort -un); do ports+=(--port "$port"); done
        [ "$R_ROUTER" = 1 ] && ports+=(--port "$R_ROUTER_PORT")
        ports+=(--starts-engines --bind-host 0.0.0.0)
    fi
    GRPO_CMD=("$GRPO_PYTHON" -m megatron_grpo.cli doctor "$RECIPE" "logging.output_dir=$GRPO_RUN_DIR"
        "${GRPO_ENGINE_OVERRIDES[@]}" "${GRPO_ARGS[@]}" --world-size "$GRPO_WORLD"
        --ranks-per-node "$GRPO_TASKS_PER_NODE" "${ports[@]}")
    GRPO_LAUNCH=(srun --nodes="$GRPO_NNODES" --ntasks-per-node=1 --ntasks="$GRPO_NNODES" --job-name=doctor
        --kill-on-bad-exit=0 --output="$GRPO_LOG_DIR/doctor-%N.log")
}

grpo_doctor() {
    local log blockers=""
    grpo_doctor_cmd
    grpo_log "doctor on ${GRPO_NODES[*]}: $(grpo_quote "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}")"
    "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}" && { grpo_log "doctor: every node has what the recipe needs"; return 0; }
    for log in "$GRPO_LOG_DIR"/doctor-*.log; do
        [ -f "$log" ] || continue
        blockers+=$(sed -n "s/^blocker: /  $(basename "$log" .log | sed 's/^doctor-//'): /p" "$log")$'\n'
    done
    grpo_die "the doctor found what would stop the run (tables in $GRPO_LOG_DIR/doctor-*.log):"$'\n'"${blockers:-  (no blocker lines: see the logs)}"
}

# The engines' and the router's key: the job's own, random (GRPO_SGLANG_API_KEY set outside wins).
# Exported, so every srun step gets it in its environment; `ps` shows none of it.
grpo_api_key() {
    [ $(( ${#GRPO_ENGINE_HOST[@]} + ${#GRPO_RM_NAME[@]} )) -gt 0 ] || return 0
    if [ -z "${GRPO_SGLANG_API_KEY:-}" ]; then
        GRPO_SGLANG_API_KEY=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
        [ "${#GRPO_SGLANG_API_KEY}" = 64 ] || grpo_die "could not make the engines' API key from /dev/urandom"
        GRPO_KEY_MADE_HERE=1  # a resubmission makes its own; a key set outside is kept
    fi
    export GRPO_SGLANG_API_KEY
}

# ------------------------------------------------------------------------------ dry run
grpo_dry_run() {
    local k n idx r0 gpus i
    echo "[dry-run] recipe=$RECIPE nodes=${GRPO_NNODES} (${GRPO_NODES[*]}) gpus_per_node=$GPUS_PER_NODE placement=$GRPO_PLACEMENT trainer_nodes=$GRPO_TRAINER_NNODES tasks_per_node=$GRPO_TASKS_PER_NODE world=$GRPO_WORLD engines=${#GRPO_ENGINE_HOST[@]} run_dir=$GRPO_RUN_DIR"
    echo "[dry-run] env NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-} OMP_NUM_THREADS=$OMP_NUM_THREADS"
    grpo_doctor_cmd
    echo "[dry-run] doctor :: $(grpo_quote "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}")"
    [ "${#GRPO_ENGINE_HOST[@]}" -gt 0 ] && echo "[dry-run] env GRPO_SGLANG_API_KEY=<${#GRPO_SGLANG_API_KEY} random hex digits, this job's; exported to every step, on no command line>"
    for ((k = 0; k < ${#GRPO_ENGINE_HOST[@]}; k++)); do
        grpo_engine_cmd "$k"
        echo "[dry-run] launch :: $(grpo_quote "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}")"
        echo "[dry-run] node=${GRPO_ENGINE_HOST[$k]} role=engine id=$k gpus=${GRPO_ENGINE_GPUS[$k]} url=$(grpo_engine_url "$k") :: $(grpo_quote "${GRPO_CMD[@]}")"
    done
    if [ "${#GRPO_ENGINE_HOST[@]}" -gt 0 ] && [ "$R_ROUTER" = 1 ]; then
        grpo_router_cmd
        echo "[dry-run] node=$GRPO_BATCH_HOST role=router url=$GRPO_ROUTER_URL :: $(grpo_quote "${GRPO_CMD[@]}")"
    fi
    for ((k = 0; k < ${#GRPO_RM_NAME[@]}; k++)); do  # started before the engines
        grpo_rm_cmd "$k"
        echo "[dry-run] launch :: $(grpo_quote "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}")"
        echo "[dry-run] node=$GRPO_BATCH_HOST role=reward_model name=${GRPO_RM_NAME[$k]} id=$k gpus=$GRPO_RM_GPUS url=$(grpo_rm_url "$k") :: $(grpo_quote "${GRPO_CMD[@]}")"
    done
    grpo_trainer_cmd
    echo "[dry-run] launch :: $(grpo_quote "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}")"
    for ((idx = 0; idx < GRPO_TRAINER_NNODES; idx++)); do
        n=${GRPO_TRAINER_NODES[$idx]}; r0=$((idx * GRPO_TASKS_PER_NODE)); gpus=""
        if [ "$GPUS_PER_NODE" -gt 0 ]; then
            for ((i = 0; i < GRPO_TASKS_PER_NODE; i++)); do gpus+="${gpus:+,}$i"; done
        else gpus=none; fi
        echo "[dry-run] node=$n role=trainer ranks=$r0-$((r0 + GRPO_TASKS_PER_NODE - 1)) tasks=$GRPO_TASKS_PER_NODE gpus=$gpus gpu_of_task=local_rank :: $(grpo_quote "${GRPO_CMD[@]}")"
    done
}

# ------------------------------------------------------------------------------ processes
grpo_start_bg() {  # grpo_start_bg NAME LOG CMD...: start in the background, remember the pid
    local name=$1 log=$2; shift 2
    printf '$ %s\n' "$(grpo_quote "$@")" >> "$log"
    "$@" >> "$log" 2>&1 &
    GRPO_PIDS+=("$!"); GRPO_PID_NAMES+=("$name")
    printf '%s %s\n' "$!" "$name" >> "$GRPO_RUN_DIR/pids.txt"
    grpo_log "started $name (pid $!, log $log)"
}

grpo_stop_servers() {
    local i pid waited=0 grace=${SERVER_STOP_GRACE_S:-20} left
    [ "${#GRPO_PIDS[@]}" -gt 0 ] || return 0
    for i in "${!GRPO_PIDS[@]}"; do kill -TERM "${GRPO_PIDS[$i]}" 2>/dev/null; done
    while :; do
        left=0
        for pid in "${GRPO_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && left=$((left + 1)); done
        [ "$left" = 0 ] && break
        if [ "$waited" -ge $((grace * 5)) ]; then
            for pid in "${GRPO_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
            grpo_log "killed $left server process(es) after ${grace}s"
            break
        fi
        sleep 0.2; waited=$((waited + 1))
    done
    for i in "${!GRPO_PIDS[@]}"; do wait "${GRPO_PIDS[$i]}" 2>/dev/null; done
    grpo_log "stopped servers: ${GRPO_PID_NAMES[*]} (pids ${GRPO_PIDS[*]})"
    GRPO_PIDS=(); GRPO_PID_NAMES=()
}

grpo_health_ok() {  # grpo_health_ok URL PATH: GET URL+PATH answers 2xx
    if command -v curl >/dev/null; then curl -sf -m 30 -o /dev/null "$1$2"
    else "$GRPO_PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + sys.argv[2], timeout=30)' "$1" "$2" 2>/dev/null; fi
}

grpo_wait_healthy() {  # grpo_wait_healthy PID_INDEX_OFFSET PATH URL...: every URL answers PATH
    local offset=$1 path=$2 deadline url i pending
    shift 2
    deadline=$(($(date +%s) + ${SGLANG_STARTUP_TIMEOUT_S:-$R_STARTUP_TIMEOUT}))
    pending=("$@")
    while [ "${#pending[@]}" -gt 0 ]; do
        for ((i = offset; i < ${#GRPO_PIDS[@]}; i++)); do
            kill -0 "${GRPO_PIDS[$i]}" 2>/dev/null || {
                # SGLang logs its settings, the key among them: the tail goes to the job's .out file
                tail -n 30 "$GRPO_LOG_DIR/${GRPO_PID_NAMES[$i]}"*.log 2>/dev/null \
                    | { if [ -n "${GRPO_SGLANG_API_KEY:-}" ]; then sed "s/${GRPO_SGLANG_API_KEY}/***/g"; else cat; fi; } >&2
                grpo_die "${GRPO_PID_NAMES[$i]} exited before all servers were healthy (logs in $GRPO_LOG_DIR)"; }
        done
        local still=()
        for url in "${pending[@]}"; do grpo_health_ok "$url" "$path" || still+=("$url"); done
        pending=("${still[@]}")
        [ "${#pending[@]}" = 0 ] && break
        [ "$(date +%s)" -lt "$deadline" ] || grpo_die "not healthy after ${SGLANG_STARTUP_TIMEOUT_S:-$R_STARTUP_TIMEOUT}s: ${pending[*]} (logs in $GRPO_LOG_DIR)"
        sleep 2
    done
    grpo_log "healthy: $*"
}

grpo_on_signal() {
    GRPO_SIGNAL=$1
    grpo_log "received SIG$1: asking the trainer to stop (it checkpoints), then stopping servers"
    [ -n "$GRPO_TRAINER_PID" ] && kill -"$1" "$GRPO_TRAINER_PID" 2>/dev/null
    [ -n "$GRPO_TRAINER_PID" ] || exit 143   # nothing to wait for: the EXIT trap cleans up
}

grpo_resubmit() {
    local count=${GRPO_RESUBMIT_COUNT:-0} script unset_args=() v extra=()
    [ "${GRPO_RESUBMIT:-0}" = 1 ] && [ -n "$GRPO_SIGNAL" ] || return 0
    if [ "$count" -ge "${GRPO_MAX_RESUBMITS:-5}" ]; then grpo_log "not resubmitting: $count resubmissions already (GRPO_MAX_RESUBMITS)"; return 0; fi
    script=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
    [ -r "$script" ] || script=$0
    # This job's SLURM_* variables must not leak into the next job (SLURM_CONF may stay).
    for v in $(compgen -e | grep '^SLURM_' | grep -v '^SLURM_CONF$'); do unset_args+=(-u "$v"); done
    [ "${GRPO_KEY_MADE_HERE:-0}" = 1 ] && unset_args+=(-u GRPO_SGLANG_API_KEY)  # the next job makes its own
    read -r -a extra <<< "${GRPO_SBATCH_ARGS:-}"
    if env "${unset_args[@]}" GRPO_RUN_DIR="$GRPO_RUN_DIR" GRPO_RESUBMIT_COUNT=$((count + 1)) \
        sbatch --dependency="afterany:$SLURM_JOB_ID" --nodes="$SLURM_JOB_NUM_NODES" "${extra[@]}" "$script" "${GRPO_ARGS[@]}" \
        >> "$GRPO_LOG_FILE" 2>&1; then
        grpo_log "resubmitted $script (resubmission $((count + 1))): $(tail -n 1 "$GRPO_LOG_FILE")"
    else
        grpo_log "ERROR: resubmission failed (see $GRPO_LOG_FILE)"
    fi
}

grpo_on_exit() {
    local rc=$?
    trap - EXIT USR1 TERM INT
    grpo_stop_servers
    grpo_resubmit
    grpo_log "done: exit code $rc, run folder $GRPO_RUN_DIR"
    exit "$rc"
}

# ------------------------------------------------------------------------------ main
grpo_main() {
    GRPO_ARGS=("$@")
    : "${RECIPE:?RECIPE is not set}"
    GRPO_PYTHON=${GRPO_PYTHON:-$(command -v python || command -v python3)}
    [ -n "$GRPO_PYTHON" ] || grpo_die "no python on PATH: activate the environment with megatron-grpo or set GRPO_PYTHON"
    [ -n "${HF_MODEL:-}" ] && GRPO_ARGS=("model.path=$HF_MODEL" "${GRPO_ARGS[@]}")
    [ -n "${VAL_FILES:-}" ] && GRPO_ARGS=("data.val_files=[${VAL_FILES}]" "${GRPO_ARGS[@]}")
    [ -n "${TRAIN_FILES:-}" ] && GRPO_ARGS=("data.train_files=[${TRAIN_FILES}]" "${GRPO_ARGS[@]}")

    grpo_check_python
    grpo_allocation
    grpo_read_recipe
    grpo_read_reward_models
    grpo_check_engine_python
    grpo_plan
    grpo_check_ports
    GRPO_RUN_DIR=${GRPO_RUN_DIR:-${OUTPUT_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/outputs}/${SLURM_JOB_NAME:-grpo}-${SLURM_JOB_ID:-dryrun}}
    GRPO_LOG_DIR=$GRPO_RUN_DIR/logs
    grpo_network_env
    grpo_api_key
    # The full recipe check, batch sizes against the data-parallel size and the engines against the
    # trainer's GPUs included (with the engine URLs the trainer gets); the resolved config is kept
    # in the run folder.
    grpo_engine_overrides
    GRPO_CONFIG_YAML=$("$GRPO_PYTHON" -m megatron_grpo.cli config show "$RECIPE" "${GRPO_ENGINE_OVERRIDES[@]}" "${GRPO_ARGS[@]}" \
        --world-size "$GRPO_WORLD" --ranks-per-node "$GRPO_TASKS_PER_NODE" 2>&1) \
        || grpo_die "recipe $RECIPE with $GRPO_WORLD trainer ranks: $(tail -n 1 <<< "$GRPO_CONFIG_YAML")"
    if [ "${DRY_RUN:-0}" = 1 ]; then grpo_dry_run; return 0; fi

    mkdir -p "$GRPO_LOG_DIR" || grpo_die "cannot create $GRPO_LOG_DIR"
    chmod 700 "$GRPO_LOG_DIR" || grpo_die "cannot make $GRPO_LOG_DIR private (chmod 700): SGLang logs its key there"
    GRPO_LOG_FILE=$GRPO_LOG_DIR/batch.log
    trap grpo_on_exit EXIT
    trap 'grpo_on_signal USR1' USR1
    trap 'grpo_on_signal TERM' TERM
    trap 'grpo_on_signal TERM' INT   # srun needs two INTs to stop; TERM stops it at once
    grpo_log "job ${SLURM_JOB_ID} on ${GRPO_NODES[*]}: recipe $RECIPE, placement $GRPO_PLACEMENT, trainer $GRPO_TRAINER_NNODES node(s) x $GRPO_TASKS_PER_NODE task(s), ${#GRPO_ENGINE_HOST[@]} engine(s), run folder $GRPO_RUN_DIR"
    env | grep -E '^(SLURM_|NCCL_|GLOO_|CUDA_|OMP_|GRPO_|SGLANG_|HF_|RECIPE=|TRAIN_FILES=|VAL_FILES=|OUTPUT_ROOT=|ENGINE_|GPUS_PER_NODE=|TASKS_PER_NODE=)' \
        | grep -v '_API_KEY=' | sort > "$GRPO_RUN_DIR/env-${SLURM_JOB_ID}.txt"
    printf '%s\n' "$GRPO_CONFIG_YAML" > "$GRPO_RUN_DIR/config-${SLURM_JOB_ID}.yaml"
    DRY_RUN=1 grpo_dry_run > "$GRPO_RUN_DIR/commands-${SLURM_JOB_ID}.txt"
    grpo_doctor

    grpo_start_reward_models
    local k urls=()
    for ((k = 0; k < ${#GRPO_ENGINE_HOST[@]}; k++)); do
        grpo_engine_cmd "$k"
        grpo_start_bg "sglang-$k" "$GRPO_LOG_DIR/launch-sglang-$k.log" "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}"
        urls+=("$(grpo_engine_url "$k")")
    done
    if [ "${#urls[@]}" -gt 0 ]; then
        grpo_wait_healthy 0 /health_generate "${urls[@]}"
        if [ "$R_ROUTER" = 1 ]; then
            grpo_router_cmd
            grpo_start_bg router "$GRPO_LOG_DIR/router.log" "${GRPO_CMD[@]}"
            grpo_wait_healthy "$(( ${#GRPO_PIDS[@]} - 1 ))" /readiness "$GRPO_ROUTER_URL"
        fi
    fi

    grpo_run_trainer
}

# grpo_trainer_step: one srun step of the trainer, waited for; its exit code. A trapped USR1/TERM
# ends `wait` early: the trainer (which got the signal through srun) gets TRAINER_STOP_GRACE_S to
# checkpoint and exit, then its step is killed.
grpo_trainer_step() {
    local rc deadline
    "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}" >> "$GRPO_LOG_FILE" 2>&1 &
    GRPO_TRAINER_PID=$!
    wait "$GRPO_TRAINER_PID"; rc=$?
    deadline=$(($(date +%s) + ${TRAINER_STOP_GRACE_S:-100}))
    while kill -0 "$GRPO_TRAINER_PID" 2>/dev/null; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            grpo_log "trainer still running ${TRAINER_STOP_GRACE_S:-100}s after SIG$GRPO_SIGNAL: killing its srun"
            kill -KILL "$GRPO_TRAINER_PID" 2>/dev/null
        fi
        sleep 1
    done
    [ -z "$GRPO_SIGNAL" ] || { wait "$GRPO_TRAINER_PID"; rc=$?; }
    GRPO_TRAINER_PID=""
    return "$rc"
}

# grpo_run_trainer: the trainer step, started again after a failure (a rank died, or the hang
# watchdog stopped it: exit 3) on the same allocation while the engines and the router keep running,
# up to GRPO_MAX_RESTARTS times in a row without a newer checkpoint. megatron_grpo.launch.restarts
# decides and writes restarts.jsonl; the new trainer resumes from the newest complete checkpoint and
# pushes its weights to the engines (as every resume does).
grpo_run_trainer() {
    local rc offset started decision extra=()
    while :; do
        grpo_trainer_cmd
        GRPO_CMD+=("${extra[@]}")
        grpo_log "trainer: $(grpo_quote "${GRPO_LAUNCH[@]}" "${GRPO_CMD[@]}")"
        offset=$(stat -c %s "$GRPO_LOG_FILE" 2>/dev/null || echo 0); started=$(date +%s.%N)
        grpo_trainer_step; rc=$?
        [ "$rc" = 0 ] && return 0
        grpo_log "trainer failed with exit code $rc; last lines of rank 0's log:"
        tail -n 20 "$GRPO_LOG_DIR/trainer-0.log" 2>/dev/null | sed 's/^/    /'
        [ -z "$GRPO_SIGNAL" ] || return "$rc"   # asked to stop: no restart (GRPO_RESUBMIT may resubmit)
        [ "${GRPO_MAX_RESTARTS:-3}" -gt 0 ] || return "$rc"
        decision=$("$GRPO_PYTHON" -m megatron_grpo.launch.restarts "$GRPO_RUN_DIR" --exit-code "$rc" \
            --srun-log "$GRPO_LOG_FILE" --log-offset "$offset" --started "$started" \
            --save-dir "${R_SAVE_DIR:-$GRPO_RUN_DIR/checkpoints}" --max-restarts "${GRPO_MAX_RESTARTS:-3}")
        local decided=$?
        grpo_log "$(head -n 1 <<< "$decision")"
        [ "$decided" = 0 ] || return "$rc"
        # continue from the run's own newest checkpoint (also when the first start was told another)
        extra=(); [ "$(sed -n 's/^step=//p' <<< "$decision")" -gt 0 ] && extra=(checkpoint.resume=auto)
    done
}
