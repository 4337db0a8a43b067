#!/usr/bin/env bash
# Run N training processes on this machine, as if on N hosts: each sees its own simulated CPU devices
# (JAX_NUM_CPU_DEVICES, default 8/N) and they meet through a coordinator on a free local port.
#
#   scripts/launch_local.sh 2 --mesh dp=2,fsdp=4 --steps 20
#   JAX_NUM_CPU_DEVICES=2 scripts/launch_local.sh 4 --mesh dp=4,fsdp=2
#
# Output lines are prefixed with [pN]. If any process fails, the others are stopped and the exit status
# is the first failure's. Extra variables: PYTHON (interpreter), INIT_TIMEOUT (seconds, default 60).
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
pids=()
stop_all() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
}
trap 'stop_all; exit 130' INT TERM

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
wait  # let the log filters flush
exit $status
