# Shared by the shell benches (source it): ports, waiting for a server, and a server in a memory cgroup.
#
#   . "$(dirname "$0")/lib.sh"

# A free TCP port on loopback.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Waits until the server on PORT answers /healthz with 200 (every dataset ready), at most TRIES × 0.1 s;
# over TLS where SCHEME is https (its certificate not checked: only readiness is).
#   wait_healthy PORT [TRIES (600)]
wait_healthy() {
    for _ in $(seq "${2:-600}"); do curl -sfk "${SCHEME:-http}://127.0.0.1:$1/healthz" >/dev/null && return 0; sleep 0.1; done
    echo "the server on port $1 did not become ready" >&2
    return 1
}

# A CA and a certificate for 127.0.0.1 it signed, with its key, in DIR: ca.pem (a mount's ca_file),
# cert.pem and key.pem (the server's --tls-cert and --tls-key).
#   tls_certificate DIR
tls_certificate() {
    local d=$1
    printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' > "$d/ext.cnf"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=batchfs bench CA" -keyout "$d/ca-key.pem" \
        -out "$d/ca.pem" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout "$d/key.pem" -out "$d/cert.csr" 2>/dev/null
    openssl x509 -req -in "$d/cert.csr" -CA "$d/ca.pem" -CAkey "$d/ca-key.pem" -CAcreateserial -days 2 \
        -extfile "$d/ext.cnf" -out "$d/cert.pem" 2>/dev/null
}

# The builds a before/after bench alternates: BIN (target/release unless set) and, where set, BIN_BEFORE,
# as absolute paths in the array `builds` (BIN made absolute too).
#   bench_builds
bench_builds() {
    BIN=$(realpath "${BIN:-target/release}")
    builds=("$BIN")
    if [ -n "${BIN_BEFORE:-}" ]; then builds+=("$(realpath "$BIN_BEFORE")"); fi
}

# A build's name in a results row: the last two parts of its directory (target/release, tmp/before).
#   build_name DIR
build_name() { echo "$(basename "$(dirname "$1")")/$(basename "$1")"; }

# A bench's working directory, `work` (removed at exit by clean_up, with the mounts under it and the
# processes whose pids are added to `pids`), holding the TFRecord dataset the batch-file benches read:
# SAMPLES (10000) samples of the generator's heavy-tailed sizes, 110 KB on average, in $work/data.
#   bench_work_and_dataset
bench_work_and_dataset() {
    work=$(mktemp -d)
    pids=()
    trap 'clean_up "$work" "" "${pids[@]}"' EXIT
    "$BIN/batchfs-server" gen --format tfrecord --samples "${SAMPLES:-10000}" --mean-bytes 110000 \
        --out "$work/data" >/dev/null
}

# Unmounts every mount under WORK (`mnt`, `mnt-*`, `m-*`), stops PIDS (those given), removes the cgroups
# CG and CG-* (none with CG empty) and WORK: a bench's exit trap. Uses $BIN/batchfs.
#   clean_up WORK CG [PIDS...]
clean_up() {
    local work=$1 cg=$2
    shift 2
    for m in "$work"/mnt "$work"/mnt-* "$work"/m-*; do
        [ -d "$m" ] && { "$BIN/batchfs" umount --lazy "$m" 2>/dev/null || true; }
    done
    [ $# -gt 0 ] && { kill "$@" 2>/dev/null || true; }
    wait 2>/dev/null || true
    [ -n "$cg" ] && { rmdir "$cg" "$cg"-* 2>/dev/null || true; }
    rm -rf "$work"
}

# Starts `batchfs-server serve --listen 127.0.0.1:PORT ARGS...` of BIN in the cgroup v1 memory group CG
# (made, limited to LIMIT, page cache included), in the background, its stderr to LOG; sets
# `limited_pid`. The caller removes CG (rmdir) once the server is gone.
#   serve_limited CG LIMIT PORT LOG ARGS...
serve_limited() {
    local cg=$1 limit=$2 port=$3 log=$4
    shift 4
    mkdir -p "$cg"
    echo "$limit" >"$cg/memory.limit_in_bytes"
    sh -c "echo \$\$ > $cg/cgroup.procs && exec $BIN/batchfs-server serve --listen 127.0.0.1:$port $*" 2>"$log" &
    limited_pid=$!
}

# The peers' servers on loopback, serving WORK's files: an sshd that takes the key WORK/id (authorized for
# root until peers_stop) and an nginx with WORK as its root; sets P_SSHD and P_NGINX.
#   peers_start WORK
peers_start() {
    local work=$1
    P_SSHD=$(free_port); P_NGINX=$(free_port)
    ssh-keygen -q -t ed25519 -N "" -f "$work/hostkey"; ssh-keygen -q -t ed25519 -N "" -f "$work/id"
    mkdir -p /root/.ssh /run/sshd
    [ -e /root/.ssh/authorized_keys ] || { touch /root/.ssh/authorized_keys; touch "$work/keys-created"; }
    grep -qF "$(cat "$work/id.pub")" /root/.ssh/authorized_keys || cat "$work/id.pub" >> /root/.ssh/authorized_keys
    /usr/sbin/sshd -p "$P_SSHD" -h "$work/hostkey" -o ListenAddress=127.0.0.1 -o PidFile="$work/sshd.pid" \
        -o PermitRootLogin=prohibit-password
    cat > "$work/nginx.conf" <<CONF
worker_processes 2;
pid $work/nginx.pid;
error_log $work/nginx.err warn;
events {}
http { access_log off; sendfile on; server { listen 127.0.0.1:$P_NGINX; root $work; autoindex on; } }
CONF
    nginx -c "$work/nginx.conf"
}

# Stops what peers_start started in WORK and takes back the key it authorized.
#   peers_stop WORK
peers_stop() {
    local work=$1
    [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
    [ -f "$work/sshd.pid" ] && kill "$(cat "$work/sshd.pid")" 2>/dev/null || true
    # grep -v exits 1 when it keeps no line, so its status is ignored: the key must go even when it was
    # the only one, and a file peers_start created goes with it.
    if [ -f "$work/id.pub" ] && [ -f /root/.ssh/authorized_keys ]; then
        grep -vF "$(cat "$work/id.pub")" /root/.ssh/authorized_keys > "$work/keys" || true
        cat "$work/keys" > /root/.ssh/authorized_keys
        [ -s /root/.ssh/authorized_keys ] || [ ! -f "$work/keys-created" ] || rm -f /root/.ssh/authorized_keys
    fi
}

# A batchfs-lab netem (of the build in BIN_DIR) in front of 127.0.0.1:UPSTREAM at RTT ms, and at RATE
# Mbit/s if given; waits until it listens. Sets NETEM_PORT and NETEM_PID.
#   start_netem BIN_DIR UPSTREAM RTT [RATE]
start_netem() {
    NETEM_PORT=$(free_port)
    local extra=(); [ -n "${4:-}" ] && extra=(--rate-mbit "$4")
    "$1/batchfs-lab" netem --listen "127.0.0.1:$NETEM_PORT" --upstream "127.0.0.1:$2" --rtt-ms "$3" "${extra[@]}" \
        2>/dev/null &
    NETEM_PID=$!
    for _ in $(seq 50); do (echo > "/dev/tcp/127.0.0.1/$NETEM_PORT") 2>/dev/null && break; sleep 0.05; done
}

# Mounts SRC of peers_start's sshd (through PORT: the sshd's, or a netem's in front of it) read-only
# at MNT with sshfs's defaults.
#   mount_sshfs WORK PORT SRC MNT
mount_sshfs() {
    sshfs -p "$2" -o "IdentityFile=$1/id,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,ro" \
        "root@127.0.0.1:$3" "$4"
}

# Mounts the directory PATH of peers_start's nginx (through PORT) read-only at MNT with rclone's
# defaults (an :http: remote), and waits until it lists.
#   mount_rclone PORT PATH MNT
mount_rclone() {
    rclone mount :http: "$3" --http-url "http://127.0.0.1:$1/$2/" --read-only --daemon 2>/dev/null
    for _ in $(seq 100); do [ -n "$(ls "$3" 2>/dev/null)" ] && break; sleep 0.1; done
}

# Generates the TFRecord dataset into $DATA once ($SAMPLES records of $MEAN bytes on average in $SHARDS
# shards; a marker file says it is whole, so a later run reuses it), then indexes it.
gen_and_index() {
    if [ ! -e "$DATA/.batchfs-generated" ]; then
        "$BIN/batchfs-server" gen --format tfrecord --samples "$SAMPLES" --mean-bytes "$MEAN" --shards "$SHARDS" \
            --out "$DATA" >&2
        touch "$DATA/.batchfs-generated"
    fi
    "$BIN/batchfs-server" index --dataset "d=$DATA" >&2
}
