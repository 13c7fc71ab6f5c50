# Servers for the benchmarks, on loopback, in a directory of the caller's.
# Sourced by run_stream_bench.sh and peers/run_peers.sh (bash).
#
#   bench_start_kvdepotd NAME DIR KVDEPOTD [ARGS...]  sets <NAME>_pid, <NAME>_port
#   bench_start_redis NAME DIR REDIS_SERVER [ARGS...] sets <NAME>_pid, <NAME>_port
#   bench_free_port                                   prints a free loopback port
#   bench_wait_port PORT PID LOG [SECONDS]            waits until PORT accepts
#   bench_stop_pid PID NAME                           SIGTERM, then SIGKILL after 10 s
#   bench_listener_pid PORT                           pid of the process listening on PORT
#
# Failures print the server's log and exit through bench_die (override it).

bench_die() {
    echo "bench: $*" >&2
    exit 1
}

bench_port_listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

bench_free_port() {
    local port
    for _ in $(seq 1 50); do
        port=$((20000 + RANDOM % 40000))
        bench_port_listening "$port" || { echo "$port"; return 0; }
    done
    bench_die "no free loopback port found"
}

bench_wait_port() { # port pid log [seconds]
    local port=$1 pid=$2 log=$3 tries=$((${4:-30} * 10))
    for _ in $(seq 1 "$tries"); do
        bench_port_listening "$port" && return 0
        kill -0 "$pid" 2>/dev/null || { tail -n 30 "$log" >&2; bench_die "server $pid exited"; }
        sleep 0.1
    done
    tail -n 30 "$log" >&2
    bench_die "nothing listens on port $port after ${4:-30} s"
}

bench_stop_pid() { # pid name
    local pid=$1 name=$2
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "bench: $name did not stop on SIGTERM, killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

# kvdepotd picks its own port and writes it to its port file.
bench_start_kvdepotd() { # name dir kvdepotd [args...]
    local name=$1 dir=$2 exe=$3 pid
    shift 3
    mkdir -p "$dir/data"
    "$exe" --listen 127.0.0.1:0 --data-dir "$dir/data" --port-file "$dir/port" \
        --metrics-listen '' "$@" >"$dir/kvdepotd.log" 2>&1 &
    pid=$!
    printf -v "${name}_pid" '%s' "$pid"
    for _ in $(seq 1 300); do
        # Complete once it ends with a newline.
        [ -s "$dir/port" ] && [ -z "$(tail -c1 "$dir/port")" ] && break
        kill -0 "$pid" 2>/dev/null || { cat "$dir/kvdepotd.log" >&2; bench_die "kvdepotd exited"; }
        sleep 0.1
    done
    [ -s "$dir/port" ] || { cat "$dir/kvdepotd.log" >&2; bench_die "kvdepotd wrote no port file"; }
    printf -v "${name}_port" '%s' "$(tr -d '[:space:]' <"$dir/port")"
}

# Redis without persistence, unless ARGS say otherwise (they come last, and
# Redis takes the last value of an option). It cannot pick its own port:
# random high ports are tried until one binds.
bench_start_redis() { # name dir redis-server [args...]
    local name=$1 dir=$2 exe=$3 port pid
    shift 3
    mkdir -p "$dir"
    for _ in $(seq 1 20); do
        port=$(bench_free_port)
        "$exe" --bind 127.0.0.1 --port "$port" --protected-mode yes --save '' --appendonly no \
            --dir "$dir" --logfile "$dir/redis.log" --daemonize no "$@" >/dev/null 2>&1 &
        pid=$!
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            if bench_port_listening "$port"; then
                printf -v "${name}_pid" '%s' "$pid"
                printf -v "${name}_port" '%s' "$port"
                return 0
            fi
            sleep 0.1
        done
        bench_stop_pid "$pid" redis-server
    done
    cat "$dir/redis.log" >&2 || true
    bench_die "could not start redis-server"
}

# The pid of the process listening on a loopback port (the server itself,
# not a launcher that started it).
bench_listener_pid() { # port
    ss -Htlnp "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n 1 | cut -d= -f2
}
