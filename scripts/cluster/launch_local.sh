#!/usr/bin/env bash
# Run N training processes on this machine, as if on N hosts: each sees its own simulated CPU devices
# (JAX_NUM_CPU_DEVICES, default 8/N) and they meet through a coordinator on a free local port.
#
#   scripts/cluster/launch_local.sh 2 --mesh dp=2,fsdp=4 --steps 20
#   JAX_NUM_CPU_DEVICES=2 scripts/cluster/launch_local.sh 4 --mesh dp=4,fsdp=2
#
# Output lines are prefixed with [pN]. If any process fails, the others are stopped and the exit status
# is the first failure's: each gets SIGTERM (and SIGCONT, so a stopped one can act on it), and one still
# running STOP_GRACE seconds later (default 60: a stopped or hung process never acts on SIGTERM) is
# killed with SIGKILL, its training process's process group first. Extra variables: PYTHON (interpreter),
# INIT_TIMEOUT (seconds, default 60), STOP_GRACE.
set -u -o pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NUM_PROCESSES [train args...]" >&2
    exit 2
fi
n=$1; shift
python=${PYTHON:-python}
if [[ -z "${JAX_NUM_CPU_DEVICES:-}" ]] && (( 8 % n != 0 )); then
    echo "error: 8 simulated devices do not split evenly over $n processes; set JAX_NUM_CPU_DEVICES" \
         "(devices per process, e.g. JAX_NUM_CPU_DEVICES=$(( (8 + n - 1) / n )))" >&2
    exit 2
fi
devices=${JAX_NUM_CPU_DEVICES:-$((8 / n))}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

# gloo prints "[Gloo] Rank R is connected to K peer ranks..." once per communicator (on stdout), from
# several threads at once, so lines come interleaved: keep one short line, drop every line with a
# fragment of that message (the hold space remembers that the short line was printed).
gloo='/\[Gloo\]\|connected peer ranks/{x;/seen/{x;d;};s/.*/seen/;x;s/.*/gloo: processes connected (further gloo lines hidden)/;}'
grace=${STOP_GRACE:-60}
if [[ ! "$grace" =~ ^[0-9]+$ ]]; then
    echo "error: STOP_GRACE=$grace must be a whole number of seconds" >&2
    exit 2
fi
pids=()
killer=
# The process groups a pid started: the supervisor's training process runs in its own (not the log filters).
groups_of() {
    local kid
    for kid in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
        [[ "$(cut -d' ' -f5 /proc/"$kid"/stat 2>/dev/null)" == "$kid" ]] && echo "$kid"
    done
}
running_now() {  # any of these pids still runs (a zombie has ended)
    local p state
    for p in "$@"; do
        state=$(cut -d' ' -f3 /proc/"$p"/stat 2>/dev/null)
        [[ -n "$state" && "$state" != Z ]] && return 0
    done
    return 1
}
stop_all() {
    [[ -n "$killer" ]] && return
    local pid groups=()
    for pid in "${pids[@]}"; do
        for g in $(groups_of "$pid"); do groups+=("$g"); kill -CONT -- "-$g" 2>/dev/null; done
        kill -TERM "$pid" 2>/dev/null
        kill -CONT "$pid" 2>/dev/null  # a stopped process acts on SIGTERM only once continued
    done
    # Whatever still runs after the grace period is killed: a process stopped again, or hung, never ends.
    (
        for ((t = 0; t < grace * 10; t++)); do
            running_now "${pids[@]}" "${groups[@]}" || exit 0
            sleep 0.1
        done
        for i in "${!pids[@]}"; do
            running_now "${pids[$i]}" || continue
            echo "launch_local: process $i did not stop within ${grace}s of SIGTERM (stopped or hung); killing it (SIGKILL)" >&2
            kill -KILL "${pids[$i]}" 2>/dev/null
        done
        for g in "${groups[@]}"; do
            running_now "$g" || continue
            echo "launch_local: a training process (pid $g) outlived its supervisor by ${grace}s; killing its process group (SIGKILL)" >&2
            kill -KILL -- "-$g" 2>/dev/null
        done
    ) &
    killer=$!
}
trap 'stop_all; wait "${pids[@]}" "$killer"; exit 130' INT TERM

for ((i = 0; i < n; i++)); do
    # Only this process's output goes through its prefixing filter; `exec` keeps $! the Python pid.
    ( JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=$devices PYTHONUNBUFFERED=1 \
        exec "$python" -m jaxdist.train --coordinator "127.0.0.1:$port" --num-processes "$n" \
        --process-id "$i" --init-timeout "${INIT_TIMEOUT:-60}" "$@" ) \
        > >(sed -u -e "$gloo" -e "s/^/[p$i] /") 2> >(sed -u -e "$gloo" -e "s/^/[p$i] /" >&2) &
    pids+=($!)
done

status=0
declare -A running
for ((i = 0; i < n; i++)); do running[${pids[$i]}]=$i; done
while (( ${#running[@]} > 0 )); do
    wait -n -p done_pid "${!running[@]}"
    rc=$?
    who=${running[$done_pid]}
    unset "running[$done_pid]"
    if (( rc != 0 && status == 0 )); then
        status=$rc
        echo "launch_local: process $who exited with status $rc; stopping the others" >&2
        stop_all
    fi
done
wait  # the stopping (at most the grace period), and the log filters' last lines
exit $status
